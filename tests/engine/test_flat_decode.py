"""The flat decode loop (`engine/flat_decode.py`) gives the modules' forward's bits.

Each model runs the same mixed batch three times: with the engine's default decode step (the
flat loop where it applies, its layers in C++), with the loop's layers in Python, and with the
modules' forward (`EagerDecode`): every token and every logprob is equal, and the flat loop,
in the form asked for, did run the decode steps. Llama (dense fp32), Qwen2
(biases on q/k/v), Mistral (a sliding window shorter than the contexts) and a Q4_1 GGUF (the
4-bit kernels, both modes) qualify; Qwen3 (q/k norms) and the torch attention backend do not,
and run the modules' forward."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.decode_step import EagerDecode
from pdserve.engine.flat_decode import FlatDecode, FlatState
from tests.helpers.checkpoints import VOCAB, save_tiny
from tests.helpers.engine import assert_idle, random_prompts
from tests.helpers.gguf_files import gguf_from_hf, q4_1_linears

# 14 requests: the decode batch passes through the int4 GEMV's rows and the narrow panels.
LENGTHS = [5, 60, 17, 3, 33, 9, 52, 21, 11, 40, 7, 26, 14, 70]


def _params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=12 + i % 5, ignore_eos=True, logprobs=1,
                           temperature=0.0 if i % 2 == 0 else 0.9,
                           seed=None if i % 2 == 0 else 40 + i)
            for i in range(len(LENGTHS))]


def _run(model: str, eager: bool, native: bool = True,
         **options) -> tuple[list, FlatDecode | None]:
    llm = LLM(model, dtype="float32", enable_prefix_caching=False, **options)
    runner = llm.engine.runner
    if eager:
        runner.decode_step = EagerDecode(runner.model)
    elif not native:
        runner.decode_step = FlatDecode(runner.model, native=False)
    outs = llm.generate(random_prompts(LENGTHS, VOCAB, seed=3), _params())
    assert_idle(llm)
    numbers = [(o.token_ids, [(lp.logprob, lp.top) for lp in o.logprobs]) for o in outs]
    return numbers, (None if eager else runner.decode_step)


def _assert_flat_gives_eager_bits(model: str, **options) -> None:
    """The C++ layers, the Python layers and the modules give the same numbers."""
    native, step = _run(model, eager=False, **options)
    assert isinstance(step, FlatDecode) and step.state is FlatState.NATIVE
    assert step.flat_steps > 10
    flat, step = _run(model, eager=False, native=False, **options)
    assert step.state is FlatState.FLAT and step.flat_steps > 10
    eager = _run(model, eager=True, **options)[0]
    assert native == eager
    assert flat == eager


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_dense_models_get_the_modules_bits(tmp_path, family):
    model = save_tiny(tmp_path / family, family, seed=21)
    _assert_flat_gives_eager_bits(str(model))


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flat")
    hf = save_tiny(tmp / "hf", "llama", seed=22, hidden_size=128, intermediate_size=256,
                   num_attention_heads=4, num_key_value_heads=2)

    return str(gguf_from_hf(hf, tmp / "q4.gguf", "llama", q4_1_linears))


@pytest.mark.parametrize("invariant", [False, True])
def test_the_4_bit_kernels_get_the_modules_bits(q4_gguf, invariant):
    _assert_flat_gives_eager_bits(q4_gguf, batch_invariant=invariant)


def test_a_model_or_backend_without_a_flat_form_runs_the_modules(tmp_path):
    qwen3 = str(save_tiny(tmp_path / "qwen3", "qwen3", seed=23))
    step = _run(qwen3, eager=False)[1]
    assert step.state is FlatState.EAGER and step.flat_steps == 0
    llama = str(save_tiny(tmp_path / "llama", "llama", seed=24))
    step = _run(llama, eager=False, attention_backend="torch")[1]
    assert step.flat_steps == 0


def test_linears_without_a_native_form_keep_the_python_layers(q4_gguf):
    # torch's own int4 kernels offer a bound callable only: the loop runs, in Python.
    flat, step = _run(q4_gguf, eager=False, int4_kernel="cpu-torch")
    assert step.state is FlatState.FLAT and step.flat_steps > 10
    assert flat == _run(q4_gguf, eager=True, int4_kernel="cpu-torch")[0]


def test_speculative_verification_steps_run_the_loop_with_the_modules_bits(tmp_path):
    # A verification step brings k + 1 query tokens a request, all the C++ attention's: the
    # loop runs it too. One request, so more tokens than steps means multi-token steps ran.
    model = str(save_tiny(tmp_path / "llama", "llama", seed=25))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    prompt = random_prompts([9], VOCAB, seed=4)[0] * 3  # repeats, so the n-grams propose
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=1, temperature=0.0)

    def run(eager: bool):
        llm = LLM(model, dtype="float32", enable_prefix_caching=False, speculative_config=spec)
        if eager:
            llm.engine.runner.decode_step = EagerDecode(llm.engine.runner.model)
        out = llm.generate([prompt], params)[0]
        assert llm.engine.stats()["spec_drafts_proposed"] > 0
        assert_idle(llm)
        return ((out.token_ids, [(lp.logprob, lp.top) for lp in out.logprobs]),
                llm.engine.runner.decode_step)

    flat, step = run(eager=False)
    assert step.state is FlatState.NATIVE and step.flat_tokens > step.flat_steps
    assert flat == run(eager=True)[0]
