"""vLLM's command line on `pdserve up`: the model as first argument, the engine flags passed
to every worker (which parse the same names), the API flags to the router, vLLM's habitual
no-op flags accepted, and a help line for every flag."""

from __future__ import annotations

import argparse

import pytest

from pdserve import cli
from pdserve.serving.worker_options import add_worker_args, options_from_args
from router.__main__ import parse as parse_router

VLLM_LINE = ["MODELDIR", "--dtype", "bfloat16", "--max-model-len", "2048", "--block-size", "32",
             "--max-num-seqs", "64", "--max-num-batched-tokens", "4096",
             "--no-enable-prefix-caching", "--quantization", "fp8", "--kv-cache-dtype", "fp8",
             "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
             "--served-model-name", "smol", "alias", "--chat-template", "t.jinja",
             "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
             "--enable-prompt-tokens-details", "--enforce-eager", "--trust-remote-code",
             "--gpu-memory-utilization", "0.9", "--tensor-parallel-size", "2"]


def up_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd")
    cli._add_up(sub.add_parser("up"))
    return p


def test_a_vllm_command_line_reaches_the_workers_and_the_router(tmp_path):
    a = up_parser().parse_args(["up", *VLLM_LINE])
    assert a.model_arg == "MODELDIR" and a.tensor_parallel_size == 2
    worker_args = cli.engine_worker_args(a)
    wp = argparse.ArgumentParser()
    add_worker_args(wp)
    engine = options_from_args("decode", wp.parse_args(["--model", "m", *worker_args])).engine
    assert (engine.dtype, engine.max_model_len, engine.block_size) == ("bfloat16", 2048, 32)
    assert (engine.max_num_seqs, engine.max_num_batched_tokens) == (64, 4096)
    assert engine.enable_prefix_caching is False
    assert (engine.quantization, engine.kv_cache_dtype, engine.model_id) == ("fp8", "fp8", "smol")
    assert engine.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    router_args = [x if x != "t.jinja" else str(tmp_path / "t.jinja")
                   for x in cli.api_router_args(a)]
    cfg, http = parse_router(["--model", "m", "--decode", "127.0.0.1:1", *router_args])
    assert (cfg.model_id, cfg.model_aliases) == ("smol", ("alias",))
    assert cfg.chat_template == "{{ messages[0]['content'] }}"
    assert (cfg.tool_call_parser, cfg.enable_auto_tool_choice) == ("hermes", True)
    assert http.api.tools.parser == "hermes" and http.api.prompt_tokens_details


def test_unset_engine_flags_are_not_passed_on():
    a = up_parser().parse_args(["up"])
    assert cli.engine_worker_args(a) == () and cli.api_router_args(a) == ()
    assert a.model_arg is None


def test_old_spellings_still_work():
    wp = argparse.ArgumentParser()
    add_worker_args(wp)
    o = options_from_args("prefill", wp.parse_args(["--model", "m", "--no-prefix-caching",
                                                    "--model-id", "x"]))
    assert o.engine.enable_prefix_caching is False and o.engine.model_id == "x"


def test_auto_tool_choice_needs_a_parser():
    with pytest.raises(SystemExit):
        parse_router(["--model", "m", "--decode", "127.0.0.1:1", "--enable-auto-tool-choice"])


@pytest.mark.parametrize("make", [up_parser, None])
def test_every_flag_has_a_help_line(make):
    if make is None:
        parser = argparse.ArgumentParser()
        add_worker_args(parser)
    else:
        parser = make()._subparsers._group_actions[0].choices["up"]
    missing = [a.option_strings for a in parser._actions
               if a.option_strings and a.help in (None, "") and a.dest != "help"]
    assert missing == []


def test_vllms_server_flags_reach_the_router_and_the_key_its_environment(monkeypatch):
    monkeypatch.delenv("PDSERVE_AUTH_TOKENS", raising=False)
    a = up_parser().parse_args(["up", "--return-tokens-as-token-ids", "--max-logprobs", "5",
                                "--enable-force-include-usage", "--root-path", "/llm",
                                "--api-key", "k1", "k2", "--disable-uvicorn-access-log"])
    args = cli.api_router_args(a)
    assert "k1" not in " ".join(args)  # a key never on the router's command line
    _, http = parse_router(["--model", "m", "--decode", "127.0.0.1:1", *args])
    assert http.api.tokens_as_ids and http.api.force_include_usage
    assert http.api.max_logprobs == 5 and http.root_path == "/llm"
    assert cli._api_key_env(a) == {"PDSERVE_AUTH_TOKENS": "k1,k2"}
    monkeypatch.setenv("VLLM_API_KEY", "v")
    _, http = parse_router(["--model", "m", "--decode", "127.0.0.1:1"])
    assert http.auth_tokens == ("v",)
