"""Prometheus metrics with vLLM's names under the ``verispec:`` prefix, in a registry of the app's own.

Every metric has vLLM's ``model_name`` label. ``spec_decode_num_accepted_tokens_per_pos_total{position}`` counts,
per draft position (0 = the first drafted token), the drafts accepted there. ``inter_token_latency_seconds`` is
observed once per engine step that committed tokens for a request (a speculative step may commit several), as in
vLLM v1.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, num_positions: int = 0):
        self.registry = CollectorRegistry()
        label = {"model_name": model_name}

        def metric(kind, name: str, doc: str, extra: tuple[str, ...] = (), **kw):
            m = kind(f"verispec:{name}", doc, ["model_name", *extra], registry=self.registry, **kw)
            return m if extra else m.labels(**label)

        self.num_drafts = metric(Counter, "spec_decode_num_drafts", "Verify steps that checked a draft.")
        self.num_draft_tokens = metric(Counter, "spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = metric(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._accepted_per_pos = metric(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, per draft position.", ("position",))
        self.running = metric(Gauge, "num_requests_running", "Requests in the running batch.")
        self.waiting = metric(Gauge, "num_requests_waiting", "Requests waiting for a seat.")
        self.kv_cache_usage = metric(Gauge, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).")
        self.preemptions = metric(Counter, "num_preemptions", "Preemptions (by recompute).")
        self.prompt_tokens = metric(Counter, "prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = metric(Counter, "generation_tokens", "Tokens generated.")
        self.time_to_first_token = metric(Histogram, "time_to_first_token_seconds",
                                          "Seconds from arrival to the first generated token.", buckets=TTFT_BUCKETS)
        self.inter_token_latency = metric(Histogram, "inter_token_latency_seconds",
                                          "Seconds between a request's steps that generated tokens.",
                                          buckets=ITL_BUCKETS)
        self.e2e_latency = metric(Histogram, "e2e_request_latency_seconds",
                                  "Seconds from arrival to the last token.", buckets=E2E_BUCKETS)
        self._label = label
        for pos in range(num_positions):  # each draft position shows from the start, at 0
            self._accepted_per_pos.labels(position=str(pos), **label)

    def spec_decode(self, drafted: int, accepted: int) -> None:
        """One verify step of one request: ``drafted`` tokens checked, the first ``accepted`` of them kept."""
        self.num_drafts.inc()
        self.num_draft_tokens.inc(drafted)
        self.num_accepted_tokens.inc(accepted)
        for pos in range(accepted):
            self._accepted_per_pos.labels(position=str(pos), **self._label).inc()

    def engine_state(self, running: int, waiting: int, kv_usage: float, new_preemptions: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_cache_usage.set(kv_usage)
        self.preemptions.inc(new_preemptions)

    def render(self) -> bytes:
        return generate_latest(self.registry)
