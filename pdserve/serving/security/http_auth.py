"""Bearer tokens on HTTP endpoints: one comparison, constant-time, for every server."""

from __future__ import annotations

import hmac
from collections.abc import Sequence


def bearer_ok(authorization: str | None, tokens: Sequence[str]) -> bool:
    """True when no token is required, or `authorization` ("Bearer <token>") carries one of
    `tokens`."""
    if not tokens:
        return True
    header = authorization or ""
    given = header[7:].strip().encode() if header[:7].lower() == "bearer " else b""
    # Compare against every token (no early exit): the time taken says nothing about which.
    return any([hmac.compare_digest(given, t.encode()) for t in tokens])
