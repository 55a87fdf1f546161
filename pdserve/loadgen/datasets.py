"""Synthetic benchmark workloads built as token ids: what each request sends and asks for.

Owns the request shapes a benchmark sends (`BenchRequest`), the three datasets and the
`Workload` they produce:

- `random`: prompts of uniformly random token ids, lengths drawn around `input_len` /
  `output_len` (`range_ratio` r gives lengths uniform in [len * (1 - r), len * (1 + r)]).
- `prefix`: multi-turn conversations that share a few system prompts. Turn k of a
  conversation re-sends the system prompt and every earlier turn (user message + answer) and
  adds a new user message, so a server with prefix caching reuses the shared part. The answers
  in the history are synthetic ids (the real outputs are unknown when the workload is built), so
  the reusable prefix is the system prompt plus the earlier turns' prompts.
- `mixed`: long prompts with short answers (the open-loop stream), plus a steady population of
  short-prompt, long-decode requests kept in flight at a fixed concurrency (closed loop): the
  workload where prefill interferes with decode.

Everything is a pure function of the spec and the seed; prompts are uniform over the vocabulary,
so no tokenizer is needed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_VOCAB_SIZE = 4096
"""The demo model's vocabulary (`DemoModelConfig.vocab_size`)."""


@dataclass(frozen=True)
class BenchRequest:
    """One request of a benchmark."""

    prompt: tuple[int, ...]
    """Prompt token ids."""
    output_len: int
    """Tokens to generate (sent as max_tokens with ignore_eos, so exactly this many)."""
    kind: str
    """Class label for per-class statistics ("random", "prefix", "long", "short")."""


@dataclass(frozen=True)
class SteadySpec:
    """A closed-loop population: `concurrency` requests always in flight, each replaced by the
    next one as soon as it finishes, for as long as the open-loop stream runs."""

    concurrency: int
    input_len: int
    output_len: int
    vocab_size: int
    seed: int
    kind: str = "short"

    def request(self, index: int) -> BenchRequest:
        """The index-th request of the population (deterministic for the seed)."""
        rng = random.Random(self.seed * 1_000_003 + index)
        return BenchRequest(_random_ids(rng, self.input_len, self.vocab_size),
                            self.output_len, self.kind)


@dataclass(frozen=True)
class Workload:
    """What a benchmark run sends."""

    requests: tuple[BenchRequest, ...]
    """The open-loop stream, in send order (paced by the arrival process)."""
    steady: SteadySpec | None = None
    """An optional closed-loop population running alongside the stream."""


@dataclass(frozen=True)
class RandomSpec:
    """Independent prompts of random token ids."""

    num_prompts: int
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    vocab_size: int = DEFAULT_VOCAB_SIZE


@dataclass(frozen=True)
class PrefixSpec:
    """Multi-turn conversations over `num_prefixes` shared system prompts."""

    num_prompts: int
    """Requests in all (turns of all conversations)."""
    num_prefixes: int = 4
    """Distinct system prompts; conversations pick one at random."""
    prefix_len: int = 512
    """Tokens in each system prompt."""
    turns: int = 3
    """Turns per conversation; turn k re-sends turns 1..k-1."""
    input_len: int = 64
    """Tokens of each new user message."""
    output_len: int = 32
    range_ratio: float = 0.0
    vocab_size: int = DEFAULT_VOCAB_SIZE


@dataclass(frozen=True)
class MixedSpec:
    """Long-prompt, short-answer requests (open loop) + steady short-prompt long decodes."""

    num_prompts: int
    """Long-prompt requests in the open-loop stream."""
    input_len: int = 2048
    output_len: int = 8
    range_ratio: float = 0.0
    short_input_len: int = 32
    short_output_len: int = 128
    short_concurrency: int = 4
    """Short-prompt, long-decode requests kept in flight at all times (0 = none)."""
    vocab_size: int = DEFAULT_VOCAB_SIZE


DatasetSpec = RandomSpec | PrefixSpec | MixedSpec


def build_workload(spec: DatasetSpec, seed: int) -> Workload:
    """The workload of a dataset spec; raises ValueError naming a bad field."""
    _validate(spec)
    rng = random.Random(seed)
    if isinstance(spec, RandomSpec):
        return Workload(tuple(_random_requests(rng, spec.num_prompts, spec.input_len,
                                               spec.output_len, spec.range_ratio,
                                               spec.vocab_size, "random")))
    if isinstance(spec, PrefixSpec):
        return Workload(tuple(_prefix_requests(rng, spec)))
    steady = None
    if spec.short_concurrency > 0:
        steady = SteadySpec(spec.short_concurrency, spec.short_input_len,
                            spec.short_output_len, spec.vocab_size, seed)
    long = _random_requests(rng, spec.num_prompts, spec.input_len, spec.output_len,
                            spec.range_ratio, spec.vocab_size, "long")
    return Workload(tuple(long), steady)


def sample_len(rng: random.Random, mean: int, range_ratio: float) -> int:
    """A length uniform in [mean * (1 - r), mean * (1 + r)], at least 1."""
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def _random_ids(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab_size) for _ in range(n))


def _random_requests(rng: random.Random, n: int, input_len: int, output_len: int,
                     range_ratio: float, vocab_size: int, kind: str) -> list[BenchRequest]:
    out = []
    for _ in range(n):
        prompt = _random_ids(rng, sample_len(rng, input_len, range_ratio), vocab_size)
        out.append(BenchRequest(prompt, sample_len(rng, output_len, range_ratio), kind))
    return out


def _prefix_requests(rng: random.Random, spec: PrefixSpec) -> list[BenchRequest]:
    prefixes = [_random_ids(rng, spec.prefix_len, spec.vocab_size)
                for _ in range(spec.num_prefixes)]
    n_conv = math.ceil(spec.num_prompts / spec.turns)
    conversations = [_conversation(rng, rng.choice(prefixes), spec) for _ in range(n_conv)]
    # Turn by turn across conversations: turn k of a conversation is sent after its turn k-1.
    # Within a round the conversations come in a fresh random order, as users' replies do; a
    # fixed order would put each conversation's turns exactly n_conv requests apart, which
    # hands a round-robin router perfect affinity whenever its pool size divides n_conv.
    ordered = []
    for t in range(spec.turns):
        order = list(range(n_conv))
        rng.shuffle(order)
        ordered += [conversations[c][t] for c in order]
    return ordered[:spec.num_prompts]


def _conversation(rng: random.Random, prefix: Sequence[int],
                  spec: PrefixSpec) -> list[BenchRequest]:
    history = list(prefix)
    turns = []
    for _ in range(spec.turns):
        history += _random_ids(rng, sample_len(rng, spec.input_len, spec.range_ratio),
                               spec.vocab_size)
        output_len = sample_len(rng, spec.output_len, spec.range_ratio)
        turns.append(BenchRequest(tuple(history), output_len, "prefix"))
        history += _random_ids(rng, output_len, spec.vocab_size)  # the synthetic answer
    return turns


def _validate(spec: DatasetSpec) -> None:
    positive = ["num_prompts", "input_len", "output_len", "vocab_size"]
    if isinstance(spec, PrefixSpec):
        positive += ["num_prefixes", "prefix_len", "turns"]
    if isinstance(spec, MixedSpec):
        positive += ["short_input_len", "short_output_len"]
        if spec.short_concurrency < 0:
            raise ValueError(f"short_concurrency: must be >= 0, got {spec.short_concurrency}")
    for name in positive:
        value = getattr(spec, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    if not 0.0 <= spec.range_ratio < 1.0:
        raise ValueError(f"range_ratio: must be in [0, 1), got {spec.range_ratio}")
