"""Token ids → streamed text, with stop strings.

Shared by the offline `LLM` and the router, so both cut text at the same place. Text that could
still turn into a stop string is held back (at most the longest stop string minus one
character) until it cannot, or until the request ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.detokenizer import IncrementalDetokenizer
from pdserve.tokenizer import Tokenizer


@dataclass(frozen=True)
class TextDelta:
    text: str
    stopped: bool  # a stop string matched: the request must end now


class TextStream:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self._stop = tuple(stop)
        self._include = include_stop_str_in_output
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""  # decoded output so far
        self._sent = 0  # characters of _text already returned
        self._stopped = False
        self.matched: str | None = None
        """The stop string that ended the text (vLLM's `stop_reason`), once one has."""

    @property
    def text(self) -> str:
        """Output text returned so far."""
        return self._text[: self._sent]

    def add(self, token_ids: Sequence[int], final: bool = False) -> TextDelta:
        if self._stopped:
            return TextDelta("", True)
        before = len(self._text)
        self._text += self._detok.add(token_ids)
        if final:
            self._text += self._detok.flush()
        cut = self._find_stop(before)
        if cut is not None:
            self._stopped = True
            self._text = self._text[:cut]
            return self._take(len(self._text), stopped=True)
        end = len(self._text) if final else max(self._sent, len(self._text) - self._hold)
        return self._take(end, stopped=False)

    def finish(self) -> TextDelta:
        """The request ended for another reason: release whatever is held back."""
        return self.add((), final=True)

    def _find_stop(self, before: int) -> int | None:
        best: int | None = None
        for s in self._stop:
            idx = self._text.find(s, max(0, before - len(s) + 1))
            if idx >= 0:
                end = idx + len(s) if self._include else idx
                if best is None or end < best:
                    best, self.matched = end, s
        return best

    def _take(self, end: int, stopped: bool) -> TextDelta:
        delta = self._text[self._sent:end]
        self._sent = max(self._sent, end)
        return TextDelta(delta, stopped)
