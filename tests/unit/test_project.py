"""Project invariants: CI runs the README's test command verbatim."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci_lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith("#")]
    command = ci_lines[-1]
    assert "pytest" in command and "torch==2.13.0" in command
    assert f"```bash\n{command}\n```" in readme

