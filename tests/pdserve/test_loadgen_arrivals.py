"""Arrival processes: mean rate, burstiness, determinism, validation."""

from __future__ import annotations

import math
import statistics

import pytest

from pdserve.loadgen.arrivals import ArrivalProcess, ArrivalSpec, send_offsets


def _gaps(offsets):
    return [b - a for a, b in zip(offsets, offsets[1:], strict=False)]


def test_infinite_rate_sends_everything_at_once():
    assert send_offsets(5, ArrivalSpec(math.inf), seed=0) == [0.0] * 5


@pytest.mark.parametrize("spec", [
    ArrivalSpec(4.0),
    ArrivalSpec(4.0, ArrivalProcess.GAMMA, burstiness=0.5),
    ArrivalSpec(4.0, ArrivalProcess.GAMMA, burstiness=3.0),
])
def test_mean_rate_matches_the_requested_rate(spec):
    offsets = send_offsets(20_000, spec, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    rate = (len(offsets) - 1) / offsets[-1]
    assert rate == pytest.approx(4.0, rel=0.05)


def test_burstiness_sets_the_spread_of_the_gaps():
    # gamma shape k: coefficient of variation of the gaps is 1 / sqrt(k); Poisson is k = 1.
    for process, k in [(ArrivalProcess.POISSON, 1.0), (ArrivalProcess.GAMMA, 0.25),
                       (ArrivalProcess.GAMMA, 4.0)]:
        gaps = _gaps(send_offsets(20_000, ArrivalSpec(2.0, process, k), seed=2))
        cv = statistics.pstdev(gaps) / statistics.mean(gaps)
        assert cv == pytest.approx(1 / math.sqrt(k), rel=0.1)


def test_offsets_are_deterministic_for_a_seed():
    spec = ArrivalSpec(3.0)
    assert send_offsets(50, spec, seed=9) == send_offsets(50, spec, seed=9)
    assert send_offsets(50, spec, seed=9) != send_offsets(50, spec, seed=10)


@pytest.mark.parametrize("kwargs, field", [
    ({"rate": 0.0}, "request_rate"),
    ({"rate": math.nan}, "request_rate"),
    ({"rate": 1.0, "process": ArrivalProcess.GAMMA, "burstiness": 0.0}, "burstiness"),
    ({"rate": 1.0, "burstiness": 2.0}, "burstiness"),  # Poisson has no burstiness knob
])
def test_invalid_specs_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ArrivalSpec(**kwargs)
