"""The Drafter protocol is the protocol: every drafter subclasses it, and nothing outside its file probes a drafter
for an attribute with getattr / hasattr (what the engine and auto use is declared, with its default, in base.py)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import verispec.drafters as drafters
from verispec.drafters.base import Drafter

SRC = Path(drafters.__file__).resolve().parents[1]
PROTOCOL = {name for name, _ in inspect.getmembers(Drafter) if not name.startswith("__")}


def test_protocol_declares_what_the_engine_and_auto_read():
    assert {"feature_layers", "cheap", "early_stop", "adaptive", "catch_up", "last_match", "lag", "delegates",
            "propose", "update"} <= PROTOCOL


def test_every_drafter_class_subclasses_the_protocol():
    classes = [obj for mod in vars(drafters).values() if inspect.ismodule(mod) and mod.__name__.startswith(
        "verispec.drafters") for obj in vars(mod).values() if inspect.isclass(obj) and obj.__name__.endswith("Drafter")
        and obj.__module__ == mod.__name__]
    assert classes
    for cls in classes:
        assert issubclass(cls, Drafter), cls


def probes(path: Path) -> list[str]:
    """getattr / hasattr calls in a file whose attribute name (a string literal) is part of the protocol."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in PROTOCOL):
            found.append(f"{path.relative_to(SRC)}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_nothing_probes_a_drafter_outside_the_protocol_file():
    base = SRC / "verispec" / "drafters" / "base.py"
    found = [p for f in sorted((SRC / "verispec").rglob("*.py")) if f != base for p in probes(f)]
    assert not found, found


def test_the_probe_scan_can_fail(tmp_path):
    bad = tmp_path / "verispec" / "bad.py"
    bad.parent.mkdir()
    bad.write_text("def f(d):\n    return getattr(d, 'feature_layers', ())\n")
    global SRC
    old, SRC = SRC, tmp_path
    try:
        assert probes(bad) == ["verispec/bad.py:2 getattr(..., 'feature_layers')"]
    finally:
        SRC = old
