"""Log formatting: plain text for a terminal (the default) or one JSON object per line
(`PDSERVE_LOG_FORMAT=json`) for log shippers, and a request-scoped logger adapter.

JSON lines carry `ts`, `level`, `component`, `worker_id`, `logger`, `message`, then any
`extra={...}` fields the call passed (e.g. `request_id`, `status`, `tokens`), and `exc` when an
exception is attached.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping, MutableMapping
from datetime import UTC, datetime
from typing import Any

LOG_FORMAT_ENV = "PDSERVE_LOG_FORMAT"
LOG_FORMATS = ("text", "json")

# Attributes every LogRecord has: anything else on a record came from `extra=`.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """Formats each record as one JSON object on one line."""

    def __init__(self, component: str, worker_id: str = "") -> None:
        super().__init__()
        self.component = component
        self.worker_id = worker_id

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, UTC)
        out: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "component": self.component,
            "worker_id": self.worker_id,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        # default=str: an odd extra value must never make a log call fail.
        return json.dumps(out, default=str, ensure_ascii=False)


class RequestLog(logging.LoggerAdapter):
    """A logger bound to one request: every call carries `request_id` (plus any fixed fields),
    merged with the call's own `extra` (stdlib 3.11 adapters replace it instead)."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]
                ) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = {**(self.extra or {}), **kwargs.get("extra", {})}
        return msg, kwargs


def request_log(logger: logging.Logger, request_id: str, **fields: Any) -> RequestLog:
    return RequestLog(logger, {"request_id": request_id, **fields})


def make_formatter(component: str, worker_id: str, log_format: str) -> logging.Formatter:
    """The formatter for `log_format` (`text` | `json`)."""
    if log_format == "json":
        return JsonFormatter(component, worker_id)
    if log_format == "text":
        label = worker_id or component
        return logging.Formatter(f"%(asctime)s {label} %(levelname)s %(message)s")
    raise ValueError(f"{LOG_FORMAT_ENV} must be one of {', '.join(LOG_FORMATS)}, "
                     f"got {log_format!r}")


def configure_logging(component: str, worker_id: str = "",
                      env: Mapping[str, str] | None = None, level: int = logging.INFO) -> None:
    """Send this process's logs to stderr in the format `env[PDSERVE_LOG_FORMAT]` names.

    Called once from a process's `main()`; it configures the root logger, which belongs to
    the process, not to a library."""
    log_format = (env or {}).get(LOG_FORMAT_ENV, "text").strip().lower() or "text"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(make_formatter(component, worker_id, log_format))
    logging.basicConfig(level=level, handlers=[handler], force=True)
