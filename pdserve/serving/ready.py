"""How a server process (worker or router) tells whoever started it that it is up, and waits
to be told to stop. No torch here: the router and the launchers import it.

    announce_ready({"role": "decode", "address": ...})   # one `PDSERVE_READY {json}` line
    await wait_for_signal(cleanup)                        # until SIGINT/SIGTERM, then cleanup
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Awaitable, Callable

READY_PREFIX = "PDSERVE_READY "
"""The start of the one stdout line that says a process is bound; JSON follows."""


def announce_ready(info: dict) -> None:
    print(READY_PREFIX + json.dumps(info, sort_keys=True), flush=True)


async def wait_for_signal(cleanup: Callable[[], Awaitable[None]]) -> None:
    """Serve until SIGINT/SIGTERM, then run `cleanup` once."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await cleanup()
