"""The speculation core: verify.py (accepted / recovered / bonus), costs.py (the one store of measured costs and the
expected-tokens arithmetic) and policy.py (how many tokens each request drafts)."""
