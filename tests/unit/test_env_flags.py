"""On/off environment switches (VERISPEC_PACK, VERISPEC_NATIVE_CACHE, VERISPEC_HUGE_PAGES): 1 or 0, a clear
error for anything else (a switch read as "on" for "off" would silently do the opposite)."""

import pytest

from verispec.config import env_flag
from verispec.errors import ConfigError
from verispec.models import hugepages


@pytest.mark.parametrize("value,expected", [("1", True), ("0", False), (" 0 ", False), ("", True)])
def test_one_and_zero_and_unset(monkeypatch, value, expected):
    monkeypatch.setenv("VERISPEC_HUGE_PAGES", value)
    assert env_flag("VERISPEC_HUGE_PAGES") is expected
    monkeypatch.delenv("VERISPEC_HUGE_PAGES")
    assert env_flag("VERISPEC_HUGE_PAGES") is True and env_flag("VERISPEC_HUGE_PAGES", default=False) is False


@pytest.mark.parametrize("value", ["off", "no", "false", "2", "yes"])
def test_anything_else_is_refused_with_one_line(monkeypatch, value):
    monkeypatch.setenv("VERISPEC_HUGE_PAGES", value)
    with pytest.raises(ConfigError, match=f"VERISPEC_HUGE_PAGES must be 0 or 1, got '{value}'") as e:
        hugepages.available()
    assert "\n" not in str(e.value)
