"""Numbers as a person reads them: 27.0 MB, 10.9 k samples/s, 850 ms, 12.3 kJ.

Reports and the console summary show measurements through these functions, so a byte count
reads the same everywhere. Three significant digits: a run's figures vary more than that from
one run to the next. Bytes are decimal (1 kB = 1000 B, rich's convention), like the rates of
networks that they are compared with.

>>> format_bytes(26_950_528), format_rate(10_900), format_seconds(0.85), format_energy(12_345)
('27.0 MB', '10.9 k samples/s', '850 ms', '12.3 kJ')
"""

from __future__ import annotations

import math
from typing import Any

from rich.filesize import decimal

_SI = ("", "k", "M", "G", "T", "P")


def _three_digits(x: float) -> str:
    """``x`` (0 <= x < 1000) to three significant digits, without an exponent."""
    if x >= 100 or x == 0:
        return f"{x:.0f}"
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _scaled(value: float, unit: str, prefixes: tuple[str, ...], glued: bool) -> str:
    """``value`` with the largest prefix that keeps it >= 1: a unit takes its prefix ("12.3
    kJ"), a count its own word ("10.9 k samples/s")."""
    base = 1000
    sign, x = ("-" if value < 0 else ""), abs(value)
    i = 0
    # Round before choosing, so that 999.7 reads "1.00 k", not "1000".
    while i + 1 < len(prefixes) and float(_three_digits(x / base**i)) >= base:
        i += 1
    prefix = prefixes[i] + ("" if glued or not prefixes[i] else " ")
    return f"{sign}{_three_digits(x / base**i)} {prefix}{unit}"


def format_bytes(n: float) -> str:
    """A byte count in decimal units: "512 bytes", "20.5 kB", "27.0 MB"."""
    if abs(n) >= 1000:  # rounded as shown first, so that 999,960 reads "1.0 MB", not "1,000.0 kB"
        unit = 1000 ** int(math.log(abs(n), 1000))
        n = round(n / unit, 1) * unit
    return decimal(int(n))


def format_rate(per_s: float, unit: str = "samples/s") -> str:
    """A rate with an SI prefix on its count: "550 samples/s", "10.9 k samples/s"."""
    return _scaled(per_s, unit, _SI, glued=False)


def format_seconds(s: float) -> str:
    """A duration: "12.0 µs", "850 ms", "1.23 s", "2 min 05 s", "1 h 02 min"."""
    if s < 0:
        return "-" + format_seconds(-s)
    if s == 0:
        return "0 s"
    units = ((1e-6, "µs"), (1e-3, "ms"), (1.0, "s"))
    i = 0 if s < 1e-3 else 1 if s < 1 else 2
    text = _three_digits(s / units[i][0])
    if i < 2 and float(text) >= 1000:  # 999.7 ms rounds to "1.00 s", not "1000 ms"
        i += 1
        text = _three_digits(s / units[i][0])
    if i < 2 or float(text) < 60:
        return f"{text} {units[i][1]}"
    total = round(s)
    if total < 3600:
        return f"{total // 60} min {total % 60:02d} s"
    minutes = round(s / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min"


def format_energy(j: float) -> str:
    """Energy: "530 mJ", "850 J", "12.3 kJ", and from a megajoule on in watt-hours, the unit of
    an electricity bill: "278 Wh", "1.25 kWh"."""
    if abs(j) >= 999.5e3:  # what would read "1000 kJ"
        return _scaled(j / 3600, "Wh", _SI, glued=True)
    if j != 0 and abs(j) < 1:
        return f"{_three_digits(abs(j) * 1e3)} mJ" if j > 0 else "-" + format_energy(-j)
    return _scaled(j, "J", _SI[:2], glued=True)


def format_figure(name: str, value: Any) -> str:
    """``value`` of the figure called ``name`` in its unit, told by the name's ending, the way
    distml names its figures: ``*bytes*`` bytes, ``*_per_s`` a rate, ``*_s``/``seconds`` a
    duration, ``*_ms*`` milliseconds, ``*_j`` energy. A dict (bytes by collective) becomes
    "all_reduce=20.5 kB, broadcast=4.1 kB"; anything else reads as it is.

    >>> format_figure("comm_bytes", {"all_reduce": 20480}), format_figure("comm_s", 0.0123)
    ('all_reduce=20.5 kB', '12.3 ms')
    """
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}={format_figure(name, v)}" for k, v in value.items()) or "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if "bytes" in name:
        return format_bytes(value)
    if name.endswith("_per_s"):
        return format_rate(value, name.removesuffix("_per_s").replace("_", " ") + "/s")
    if name.endswith("_s") or name == "seconds":
        return format_seconds(value)
    if "_ms" in name:
        return format_seconds(value / 1e3)
    if name.endswith("_j"):
        return format_energy(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def axis_scale(values: list[float], unit: str) -> tuple[float, str]:
    """A divisor and its unit for a plot axis of ``values`` in ``unit`` ("bytes", "s", "J"
    or "samples/s"), so that ticks read 0-999: bytes in kB/MB/GB, seconds in µs/ms/s, joules
    in mJ/J/kJ, rates in samples/s, k samples/s, M samples/s.

    >>> axis_scale([2e6, 3.5e7], "bytes"), axis_scale([0.012, 0.02], "s")
    ((1000000.0, 'MB'), (0.001, 'ms'))
    """
    top = max((abs(v) for v in values), default=0.0)
    if unit == "bytes":
        steps = [(1.0, "bytes"), (1e3, "kB"), (1e6, "MB"), (1e9, "GB"), (1e12, "TB")]
    elif unit == "s":
        steps = [(1e-6, "µs"), (1e-3, "ms"), (1.0, "s")]
    elif unit == "J":
        steps = [(1e-3, "mJ"), (1.0, "J"), (1e3, "kJ"), (1e6, "MJ")]
    elif unit == "samples/s":
        steps = [(1.0, unit), (1e3, f"k {unit}"), (1e6, f"M {unit}"), (1e9, f"G {unit}")]
    else:
        raise ValueError(f"no axis scale for unit {unit!r}: expected bytes, s, J or samples/s")
    if top == 0:
        return next(step for step in steps if step[0] == 1.0)
    fits = [step for step in steps if top >= step[0]]
    return fits[-1] if fits else steps[0]
