"""JSON log lines and the request-scoped logger."""

from __future__ import annotations

import io
import json
import logging

import pytest

from pdserve.observability.logs import (
    JsonFormatter,
    configure_logging,
    make_formatter,
    request_log,
)


def _logger(formatter: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    logger = logging.Logger("test.json")  # not registered globally: no state leaks
    logger.addHandler(handler)
    return logger, out


def test_json_line_has_standard_fields_and_extras():
    logger, out = _logger(JsonFormatter("decode", "decode-0"))
    logger.info("request %s done", "r-1", extra={"request_id": "r-1", "tokens": 5})
    line = out.getvalue()
    assert line.count("\n") == 1
    rec = json.loads(line)
    assert rec["level"] == "INFO"
    assert rec["component"] == "decode"
    assert rec["worker_id"] == "decode-0"
    assert rec["message"] == "request r-1 done"
    assert rec["request_id"] == "r-1"
    assert rec["tokens"] == 5
    assert rec["ts"].endswith("Z") and "T" in rec["ts"]
    assert "args" not in rec and "msg" not in rec


def test_json_line_carries_the_exception_and_survives_odd_values():
    logger, out = _logger(JsonFormatter("router"))
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        logger.exception("failed", extra={"obj": object()})
    rec = json.loads(out.getvalue())
    assert "ValueError: boom" in rec["exc"]
    assert rec["obj"].startswith("<object")
    assert rec["worker_id"] == ""


def test_request_log_merges_the_id_with_call_extras():
    logger, out = _logger(JsonFormatter("prefill", "prefill-0"))
    rlog = request_log(logger, "abc-123", rpc="Prefill")
    rlog.info("admitted", extra={"prompt_tokens": 9})
    rec = json.loads(out.getvalue())
    assert (rec["request_id"], rec["rpc"], rec["prompt_tokens"]) == ("abc-123", "Prefill", 9)


def test_text_format_stays_human_readable():
    logger, out = _logger(make_formatter("router", "", "text"))
    logger.warning("hello", extra={"request_id": "r"})
    line = out.getvalue()
    assert " router WARNING hello" in line
    with pytest.raises(json.JSONDecodeError):
        json.loads(line)


def test_unknown_log_format_is_refused_naming_the_variable():
    with pytest.raises(ValueError, match="PDSERVE_LOG_FORMAT"):
        configure_logging("router", "", {"PDSERVE_LOG_FORMAT": "xml"})
