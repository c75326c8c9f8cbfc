"""Figures as a person reads them: the exact strings of the report and the console summary."""

from __future__ import annotations

import pytest

from distml.telemetry.units import (
    axis_scale,
    format_bytes,
    format_energy,
    format_figure,
    format_rate,
    format_seconds,
)


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 bytes"),
        (1, "1 byte"),
        (999, "999 bytes"),
        (1000, "1.0 kB"),
        (20480, "20.5 kB"),
        (26_950_528, "27.0 MB"),
        (999_949, "999.9 kB"),
        (999_960, "1.0 MB"),  # rounded as shown, then given its unit
        (3.2e9, "3.2 GB"),
    ],
)
def test_bytes_are_decimal(n: float, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize(
    "rate, text",
    [
        (0, "0 samples/s"),
        (0.5, "0.50 samples/s"),
        (550, "550 samples/s"),
        (10_900, "10.9 k samples/s"),
        (999.7, "1.00 k samples/s"),
        (1.23e6, "1.23 M samples/s"),
    ],
)
def test_rates_carry_an_si_prefix(rate: float, text: str) -> None:
    assert format_rate(rate) == text


@pytest.mark.parametrize(
    "s, text",
    [
        (0, "0 s"),
        (1.2e-5, "12.0 µs"),
        (0.0009997, "1.00 ms"),
        (0.85, "850 ms"),
        (0.0123, "12.3 ms"),
        (0.9996, "1.00 s"),
        (1.234, "1.23 s"),
        (59.97, "1 min 00 s"),
        (125, "2 min 05 s"),
        (3725, "1 h 02 min"),
        (-0.2, "-200 ms"),
    ],
)
def test_seconds(s: float, text: str) -> None:
    assert format_seconds(s) == text


@pytest.mark.parametrize(
    "j, text",
    [
        (0, "0 J"),
        (0.53, "530 mJ"),
        (850, "850 J"),
        (999.9, "1.00 kJ"),
        (12_345, "12.3 kJ"),
        (999_499, "999 kJ"),
        (999_999, "278 Wh"),
        (4.5e6, "1.25 kWh"),
    ],
)
def test_energy(j: float, text: str) -> None:
    assert format_energy(j) == text


@pytest.mark.parametrize(
    "name, value, text",
    [
        (
            "comm_bytes",
            {"all_reduce": 20480, "broadcast": 4096},
            "all_reduce=20.5 kB, broadcast=4.1 kB",
        ),
        ("bytes_pushed", 26_950_528, "27.0 MB"),
        ("samples_per_s", 13_253.5, "13.3 k samples/s"),
        ("sync_wait_s", 0.00366, "3.66 ms"),
        ("seconds", 75.0, "1 min 15 s"),
        ("latency_ms_p50", 3.2, "3.20 ms"),
        ("energy_j", 649.4, "649 J"),
        ("final_loss", 1.3051658868789673, "1.305"),
        ("steps", 12, "12"),
        ("export", None, "-"),
        ("answers_match_batch_inference", True, "True"),
        ("energy_source", "estimated:cpu-time", "estimated:cpu-time"),
        ("comm_bytes", {}, "-"),
    ],
)
def test_a_figure_reads_in_the_unit_its_name_tells(name: str, value: object, text: str) -> None:
    assert format_figure(name, value) == text


def test_axis_scale_picks_the_unit_that_keeps_ticks_below_a_thousand() -> None:
    assert axis_scale([2e6, 3.5e7], "bytes") == (1e6, "MB")
    assert axis_scale([0.012, 0.02], "s") == (1e-3, "ms")
    assert axis_scale([0.0, 0.0], "s") == (1.0, "s")
    assert axis_scale([5e-8], "s") == (1e-6, "µs")  # below the smallest: the smallest
    assert axis_scale([140.0], "J") == (1.0, "J")
    assert axis_scale([54_000.0], "samples/s") == (1e3, "k samples/s")
    with pytest.raises(ValueError, match="no axis scale for unit 'W'"):
        axis_scale([1.0], "W")
