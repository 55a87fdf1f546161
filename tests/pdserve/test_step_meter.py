"""The worker's speed model: a line fitted to (tokens in a step, seconds), with a calibration
prior; calibration itself runs dummy steps and leaves the engine as it found it."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM
from pdserve.serving.step_meter import StepMeter, calibrate


def test_no_model_until_something_was_measured():
    assert StepMeter().model().samples == 0


def test_fits_base_and_per_token_cost():
    meter = StepMeter(decay=1.0)
    for tokens in (1, 8, 32, 64, 1, 64):
        meter.observe(tokens, 0.01 + 0.001 * tokens)
    m = meter.model()
    assert m.base_s == pytest.approx(0.01) and m.per_token_s == pytest.approx(0.001)
    assert m.samples == 6 and m.seconds(10) == pytest.approx(0.02)


def test_one_batch_size_only_reads_as_proportional():
    meter = StepMeter()
    for _ in range(5):
        meter.observe(16, 0.032)
    m = meter.model()
    assert m.base_s == 0.0 and m.per_token_s == pytest.approx(0.002)


def test_the_calibration_prior_keeps_the_slope_through_a_long_run_at_one_batch():
    meter = StepMeter(decay=0.9)
    meter.calibrated([(1, 0.011), (1, 0.011), (64, 0.074), (64, 0.074)])
    for _ in range(1000):
        meter.observe(8, 0.018)  # consistent with the line
    m = meter.model()
    assert m.per_token_s == pytest.approx(0.001, rel=0.05)
    assert m.base_s == pytest.approx(0.01, rel=0.1)


def test_noise_never_gives_a_negative_cost():
    meter = StepMeter(decay=1.0)
    meter.observe(1, 0.05)
    meter.observe(64, 0.01)
    m = meter.model()
    assert m.per_token_s >= 0.0 and m.base_s >= 0.0


def test_calibration_measures_and_leaves_the_engine_idle(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", max_num_seqs=16)
    engine = llm.engine
    meter = StepMeter()
    calibrate(engine, meter, max_batch=8)
    m = meter.model()
    assert m.samples == 6 and m.per_token_s >= 0.0 and m.seconds(8) > 0.0
    assert not engine.has_unfinished() and engine.pool.is_idle()
    assert engine.pool.num_cached == 0  # no block filled: nothing for the prefix cache
