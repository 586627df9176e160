"""Human sizes, durations and ages, as users type them on the command line and read them in tables."""
from __future__ import annotations

import math
import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)b?\s*$", re.I)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str) -> int:
    """``"4GiB"`` → 4·2³⁰, ``"500MB"`` → 500·10⁶, ``"1024"`` → 1024 bytes."""
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (examples: 4GiB, 500MB, 1048576)")
    number, prefix, binary = float(m.group(1)), m.group(2).lower(), m.group(3)
    base = 1024 if binary or not prefix else 1000
    value = number * base ** _POWERS[prefix]
    if not math.isfinite(value):
        raise ValueError(f"not a size: {text!r} is too large")
    size = int(value)
    if size <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return size


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*([wdhms])", re.I)
_SECONDS = {"w": 7 * 86400, "d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(text: str) -> float:
    """``"7d"`` → 604800.0 seconds; parts add up: ``"1d12h"``, ``"90m"``, ``"2w"``, ``"30s"``."""
    compact = re.sub(r"\s+", "", text)
    parts = _DURATION_PART.findall(compact)
    if not compact or "".join(n + u for n, u in parts) != compact:
        raise ValueError(f"not a duration: {text!r} (examples: 7d, 12h, 1d12h, 30m)")
    seconds = sum(float(n) * _SECONDS[u.lower()] for n, u in parts)
    if not math.isfinite(seconds):
        raise ValueError(f"not a duration: {text!r} is too long")
    if seconds <= 0:
        raise ValueError(f"duration must be positive: {text!r}")
    return seconds


def finite(value: float) -> bool:
    """``math.isfinite``, but false, not ``OverflowError``, for an int too large for a float
    (a setting of 10**400 seconds)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def format_size(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} B"
    value, unit = nbytes / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"


def format_age(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.1f}{unit}"
    return f"{max(seconds, 0):.0f}s"
