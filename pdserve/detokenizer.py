"""Incremental detokenization: turns a stream of output token ids into a stream of text deltas.

Owns the prefix-offset / read-offset technique. Decoding one token alone is wrong in general: a
multi-byte character may be split over several tokens, and some decoders render a token
differently at the start of a text (SentencePiece strips the leading space). So each step decodes
a small window: `prefix` tokens (already emitted, kept as context) followed by the pending tokens,
and emits the window's text beyond the prefix's text:

    ids:     ... emitted ... | prefix (context) | pending (not yet emitted) |
                             0                  read                       len(ids)

The delta is held back while the window's text ends in U+FFFD (a character still incomplete).
Once emitted, the pending tokens become the next prefix and older tokens are dropped, so each
step costs O(window), not O(output length).

Invariant: the concatenation of every delta returned by `add` and then by `flush` equals
`tokenizer.decode(output_ids)` for byte-level tokenizers, whatever the ids, as long as the prompt
(if any) ends on a character boundary.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as context for the first output token: enough for decoders whose rendering
# of a token depends on its neighbours (leading-space stripping, a character in byte pieces).
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Per-request streaming decoder; not thread-safe (one request, one owner)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = [int(i) for i in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]]
        self._ids: list[int] = context  # prefix + pending tokens only
        self._read = len(context)  # start of the pending tokens in self._ids
        self._prefix_text = self._decode(context)
        self._text = ""

    @property
    def text(self) -> str:
        """All output text emitted so far (held-back characters excluded)."""
        return self._text

    @property
    def has_pending(self) -> bool:
        """True while some output tokens are held back (an incomplete character)."""
        return self._read < len(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append newly generated tokens; return the text they complete (possibly "")."""
        self._ids.extend(int(i) for i in token_ids)
        if not self.has_pending:
            return ""
        window_text = self._decode(self._ids)
        if window_text.endswith(_REPLACEMENT_CHAR):
            return ""  # a character is still split; wait for the next token
        return self._emit(window_text)

    def flush(self) -> str:
        """At the end of a request: emit what is held back, even an incomplete character."""
        if not self.has_pending:
            return ""
        return self._emit(self._decode(self._ids))

    def _emit(self, window_text: str) -> str:
        prefix = self._prefix_text
        if window_text.startswith(prefix):
            delta = window_text[len(prefix):]
        else:
            # Only when the prompt itself ends inside a character: the prefix's trailing U+FFFD
            # becomes a real character, which belongs to the output.
            delta = window_text[_common_prefix_len(prefix, window_text):]
        # The pending tokens become the context of the next step.
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._text += delta
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
