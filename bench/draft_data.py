"""Instructions for fitting and measuring a draft head on the default chat model: the head is
fitted on the model's own answers to `TRAIN` and measured on `EVAL` (disjoint)."""

from __future__ import annotations

_TOPICS = ["a hash map", "binary search", "a linked list", "TCP handshakes", "photosynthesis",
           "the water cycle", "compound interest", "recursion", "HTTP caching", "unit tests",
           "the French revolution", "black holes", "vaccines", "supply and demand",
           "a bicycle gear", "garbage collection", "public key cryptography", "rainbows",
           "volcanoes", "the Pythagorean theorem", "database indexes", "jet engines",
           "climate and weather", "sorting algorithms"]
_FORMS = ["Explain {} to a beginner in a few paragraphs.",
          "Write a short Python function related to {} and explain it line by line.",
          "List five facts about {}, one per line.",
          "Write a short story in which someone learns about {}."]

TRAIN = [f.format(t) for t in _TOPICS[:20] for f in _FORMS]
"""80 instructions (20 topics x 4 forms)."""

EVAL = [f.format(t) for t in _TOPICS[20:] for f in _FORMS]
"""16 instructions on topics the head never saw."""


def chat(tokenizer, instruction: str) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": instruction}])
