"""`pdserve bench`: flags, and one benchmark run from them (build, send, report, plot).

    pdserve bench --target 127.0.0.1:50051 --num-prompts 200 --request-rate 4 \\
        --dataset random --input-len 512 --output-len 64 --goodput ttft:500 tpot:50 \\
        --output bench.json --plot-dir plots/

Exit status: 0 when at least one request completed, 1 when none did or the server cannot be
reached, 2 for invalid flags, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from dataclasses import replace
from typing import Any

from pdserve.loadgen.arrivals import ArrivalProcess, ArrivalSpec
from pdserve.loadgen.backend import Backend, SendOptions
from pdserve.loadgen.datasets import (
    DEFAULT_VOCAB_SIZE,
    BenchRequest,
    DatasetSpec,
    MixedSpec,
    PrefixSpec,
    RandomSpec,
    Workload,
    build_workload,
)
from pdserve.loadgen.metrics import Slo, parse_slos
from pdserve.loadgen.plots import PlotUnavailable, latency_cdfs
from pdserve.loadgen.progress import make_progress
from pdserve.loadgen.report import Report, format_report, make_report, to_json, write_report
from pdserve.loadgen.runner import RunConfig, run_workload
from pdserve.serving.security import args as security_args

# Dataset-specific flags (dest names) and the datasets that take them.
_DATASET_FLAGS = {
    "num_prefixes": ("prefix",), "prefix_len": ("prefix",), "turns": ("prefix",),
    "short_input_len": ("mixed",), "short_output_len": ("mixed",),
    "short_concurrency": ("mixed",),
}
_SPECS = {"random": RandomSpec, "prefix": PrefixSpec, "mixed": MixedSpec}


def add_arguments(p: argparse.ArgumentParser) -> None:
    server = p.add_mutually_exclusive_group()
    server.add_argument("--target", default=None,
                        help="router gRPC address HOST:PORT (default 127.0.0.1:50051)")
    server.add_argument("--openai-url", default=None,
                        help="OpenAI-compatible API root, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="", help="model id (default: the server's default)")
    security_args.add_client_args(p)
    load = p.add_argument_group("load")
    load.add_argument("--num-prompts", type=int, default=100)
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="mean requests/s of the open-loop stream; inf = all at once")
    load.add_argument("--arrival", choices=[a.value for a in ArrivalProcess], default="poisson")
    load.add_argument("--burstiness", type=float, default=None,
                      help="gamma shape (gamma arrivals only; <1 burstier, >1 more regular)")
    load.add_argument("--concurrency", type=int, default=None,
                      help="cap on requests in flight (with --request-rate inf: fixed "
                           "concurrency)")
    load.add_argument("--warmup", type=int, default=1, help="requests sent first, not measured")
    load.add_argument("--seed", type=int, default=0)
    data = p.add_argument_group("dataset (token ids, uniform over the vocabulary)")
    data.add_argument("--dataset", choices=list(_SPECS), default="random")
    data.add_argument("--input-len", type=int, default=None, help="prompt (or message) tokens")
    data.add_argument("--output-len", type=int, default=None)
    data.add_argument("--range-ratio", type=float, default=None,
                      help="lengths uniform in [len*(1-r), len*(1+r)]")
    data.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                      help="token ids are drawn from [0, this); default: the demo model's (the "
                           "API does not report it)")
    data.add_argument("--num-prefixes", type=int, default=None, help="prefix: system prompts")
    data.add_argument("--prefix-len", type=int, default=None, help="prefix: system prompt tokens")
    data.add_argument("--turns", type=int, default=None, help="prefix: turns per conversation")
    data.add_argument("--short-input-len", type=int, default=None, help="mixed: steady prompts")
    data.add_argument("--short-output-len", type=int, default=None, help="mixed: steady decodes")
    data.add_argument("--short-concurrency", type=int, default=None,
                      help="mixed: short-prompt long-decode requests always in flight")
    out = p.add_argument_group("requests and output")
    out.add_argument("--temperature", type=float, default=0.0)
    out.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    out.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS",
                     help="SLOs for goodput, e.g. ttft:500 tpot:50 (metrics: ttft, tpot, e2e)")
    out.add_argument("--output", default=None, help="write the report JSON here")
    out.add_argument("--plot-dir", default=None, help="write latency CDF PNGs here")
    out.add_argument("--no-progress", action="store_true")


def dataset_spec(a: argparse.Namespace) -> DatasetSpec:
    """The dataset spec the flags describe; ValueError names a flag the dataset does not take."""
    for dest, datasets in _DATASET_FLAGS.items():
        if getattr(a, dest) is not None and a.dataset not in datasets:
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"{flag}: only applies to --dataset {'/'.join(datasets)}")
    names = ["input_len", "output_len", "range_ratio", *_DATASET_FLAGS]
    kwargs = {n: getattr(a, n) for n in names if getattr(a, n) is not None}
    return _SPECS[a.dataset](num_prompts=a.num_prompts, vocab_size=a.vocab_size, **kwargs)


def arrival_spec(a: argparse.Namespace) -> ArrivalSpec:
    burstiness = 1.0 if a.burstiness is None else a.burstiness
    return ArrivalSpec(a.request_rate, ArrivalProcess(a.arrival), burstiness)


def run(a: argparse.Namespace) -> int:
    """Runs the benchmark the flags describe; returns the exit status."""
    try:
        spec = dataset_spec(a)
        workload = build_workload(spec, a.seed)
        warmup = build_workload(replace(spec, num_prompts=a.warmup), a.seed + 1).requests \
            if a.warmup > 0 else ()
        config = RunConfig(arrival_spec(a), a.concurrency, a.seed)
        slos = parse_slos(a.goodput)
        options = SendOptions(a.temperature, a.timeout, security_args.api_token(a), a.model,
                              security_args.client_tls(a))
    except ValueError as exc:
        print(f"pdserve bench: error: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run(a, options, workload, warmup, config, slos))
    except KeyboardInterrupt:
        print("pdserve bench: interrupted", file=sys.stderr)
        return 130


async def _run(a: argparse.Namespace, options: SendOptions, workload: Workload,
               warmup: tuple[BenchRequest, ...], config: RunConfig, slos: tuple[Slo, ...]
               ) -> int:
    backend = _backend(a, options)
    try:
        try:
            info = await backend.server_info()
        except Exception as exc:  # noqa: BLE001 - any failure here means "cannot reach it"
            print(f"pdserve bench: cannot reach the server: {exc}", file=sys.stderr)
            return 1
        if problem := _length_problem(workload, warmup, info.max_model_len):
            print(f"pdserve bench: error: {problem}", file=sys.stderr)
            return 2
        bar = make_progress(len(workload.requests), "bench", not a.no_progress)
        try:
            run = await run_workload(backend, workload, config, warmup,
                                     on_done=lambda _: bar.update())
        finally:
            bar.close()
    finally:
        await backend.close()
    report = make_report(run, slos, _echo_config(a, info.model))
    print(format_report(report))
    _write_outputs(a, report)
    return 0 if report.overall.completed else 1


def _backend(a: argparse.Namespace, options: SendOptions) -> Backend:
    if a.openai_url:
        from pdserve.loadgen.openai_backend import OpenAIBackend

        return OpenAIBackend(a.openai_url, options)
    from pdserve.loadgen.grpc_backend import GrpcBackend

    return GrpcBackend(a.target or "127.0.0.1:50051", options)


def _length_problem(workload: Workload, warmup: tuple[BenchRequest, ...],
                    max_model_len: int) -> str | None:
    if max_model_len <= 0:
        return None
    requests = [*workload.requests, *warmup]
    if workload.steady is not None:
        requests.append(workload.steady.request(0))
    longest = max((len(r.prompt) + r.output_len for r in requests), default=0)
    if longest > max_model_len:
        return (f"a request needs {longest} tokens (prompt + output) but the server's context is "
                f"{max_model_len}: lower --input-len/--output-len/--prefix-len/--turns")
    return None


def _echo_config(a: argparse.Namespace, model: str) -> dict[str, Any]:
    skip = {"token", "token_file", "cmd"}
    config = {k: v for k, v in vars(a).items() if k not in skip}
    config["request_rate"] = None if math.isinf(a.request_rate) else a.request_rate
    config["server_model"] = model
    return config


def _write_outputs(a: argparse.Namespace, report: Report) -> None:
    if a.output:
        print(f"wrote {write_report(report, a.output)}")
    if a.plot_dir:
        try:
            print(f"wrote {latency_cdfs(to_json(report), f'{a.plot_dir}/latency_cdf.png')}")
        except PlotUnavailable as exc:
            print(f"pdserve bench: no plots: {exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """`python -m pdserve.loadgen` entry point (same flags as `pdserve bench`)."""
    p = argparse.ArgumentParser(prog="pdserve bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))
