"""`LLM`: the single-process engine for offline use and as the parity reference.

    llm = LLM(model_path)     # HF directory, FILE.gguf, or None: the embedded default model
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=8, temperature=0))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.engine.checkpoint import open_checkpoint
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.finish import FinishReason
from pdserve.engine.sampler import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.text_stream import TextStream

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[TokenLogprobs] | None
    num_cached_tokens: int
    prompt_logprobs: list[TokenLogprobs] | None = None
    """With `prompt_logprobs`: one entry per prompt token after the first."""


@dataclass
class _Pending:
    index: int
    prompt_ids: list[int]
    stream: TextStream
    tokens: list[int]
    logprobs: list[TokenLogprobs | None]
    cached: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None


class LLM:
    def __init__(self, model_path: str | None = None, **options: Any) -> None:
        """`model_path`: a Hugging Face checkpoint directory, a .gguf file or a directory
        holding one; None serves the embedded default model (pdserve/default_model.py)."""
        if model_path is None:
            from pdserve.default_model import ensure_default_model

            model_path = ensure_default_model()
        self.config = EngineConfig(model=str(model_path), **options)
        checkpoint = open_checkpoint(model_path)
        self.tokenizer = checkpoint.tokenizer()
        self.engine = LLMEngine(self.config, checkpoint=checkpoint)
        self._counter = 0

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[CompletionOutput]:
        prompts = _as_prompt_list(prompts)
        params_list = _broadcast(params, len(prompts))
        pending: dict[str, _Pending] = {}
        results: list[CompletionOutput | None] = [None] * len(prompts)
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
                ids = self._tokenize(prompt)
                rid = f"llm-{self._counter}"
                self._counter += 1
                self.engine.add_request(rid, ids, p)
                stream = TextStream(self.tokenizer, ids, p.stop, p.include_stop_str_in_output)
                pending[rid] = _Pending(i, ids, stream, [], [])
            while pending:
                for out in self.engine.step():
                    self._absorb(out, pending, results)
        finally:
            for rid in pending:
                self.engine.abort(rid)
        return [r for r in results if r is not None]

    def close(self) -> None:
        """Release the engine's helper processes (tensor-parallel ranks)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _absorb(self, out, pending: dict[str, _Pending], results: list) -> None:
        st = pending.get(out.request_id)
        if st is None:
            return
        st.tokens.extend(out.new_token_ids)
        st.logprobs.extend(out.new_logprobs)
        st.cached = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            st.prompt_logprobs = out.prompt_logprobs
        delta = st.stream.add(out.new_token_ids, final=out.finished)
        reason = out.finish_reason
        if delta.stopped and not out.finished:
            self.engine.finish_stopped(out.request_id)
            reason = FinishReason.STOP
        if reason is None:
            return
        del pending[out.request_id]
        lps = st.logprobs if any(lp is not None for lp in st.logprobs) else None
        results[st.index] = CompletionOutput(
            out.request_id, st.prompt_ids, st.tokens, st.stream.text, reason, lps, st.cached,
            st.prompt_logprobs)

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]  # a single prompt given as token ids
    return prompts


def _broadcast(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"params has {len(params)} entries for {n} prompts")
    return params
