"""Why a request ended: one enum shared by the engine, the workers and the router.

A `StrEnum`, so a reason is also its lowercase name ("stop", "length", "abort") wherever text
is wanted (logs, the OpenAI API's JSON, the client SDK); the protobuf mapping lives in
`pdserve.serving.convert` only.
"""

from __future__ import annotations

import enum


class FinishReason(enum.StrEnum):
    STOP = "stop"
    """An EOS or stop token, or a stop string (text level, the router)."""
    LENGTH = "length"
    """max_tokens reached, or the model's context is full."""
    ABORT = "abort"
    """Cancelled, failed, or ended by a worker for any other reason."""
