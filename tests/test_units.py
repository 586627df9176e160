from __future__ import annotations

import pytest

from tiered_kv.units import finite, format_age, format_size, parse_duration, parse_size


def test_parse_size():
    assert parse_size("4GiB") == 4 << 30 and parse_size("500MB") == 500 * 10**6
    assert parse_size("1024") == 1024
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


@pytest.mark.parametrize(
    "text, seconds", [("7d", 604800), ("12h", 43200), ("1d12h", 129600), ("90m", 5400),
                      ("1.5h", 5400), ("2w", 1209600), ("30s", 30), (" 1h 30m ", 5400)],
)
def test_parse_duration(text: str, seconds: float):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "7", "x", "7dd", "d7", "1y", "-1d"])
def test_parse_duration_rejects(text: str):
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


def test_zero_duration_is_refused():
    with pytest.raises(ValueError, match="positive"):
        parse_duration("0s")


def test_format():
    assert format_size(1536) == "1.5 KiB" and format_age(7200) == "2.0h"


def test_an_int_too_large_for_a_float_is_not_finite():
    assert finite(0.5) and finite(10**300) and not finite(float("nan")) and not finite(float("inf"))
    assert not finite(10**400)  # math.isfinite raises OverflowError
