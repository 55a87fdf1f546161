"""`--kv-nixl-reads`: on by default, off by flag or `$PDSERVE_KV_NIXL_READS=0` (how a
worker's tensor-parallel followers learn it), passed on by `pdserve up`, and carried into the
transfer engine's config."""

from __future__ import annotations

import argparse

import pytest

from pdserve import cli
from pdserve.serving.kv_transport import NIXL_READS_ENV, default_nixl_reads
from pdserve.serving.worker_options import add_worker_args, options_from_args


def worker_options(*argv: str):
    p = argparse.ArgumentParser()
    add_worker_args(p)
    return options_from_args("prefill", p.parse_args(["--model", "m", *argv]))


def test_reads_are_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv(NIXL_READS_ENV, raising=False)
    assert default_nixl_reads() is True
    assert worker_options().kv_nixl_reads is True
    assert worker_options("--no-kv-nixl-reads").kv_nixl_reads is False
    monkeypatch.setenv(NIXL_READS_ENV, "0")
    assert worker_options().kv_nixl_reads is False
    assert worker_options("--kv-nixl-reads").kv_nixl_reads is True  # the flag wins


def test_a_bad_environment_value_is_refused(monkeypatch):
    monkeypatch.setenv(NIXL_READS_ENV, "yes")
    with pytest.raises(ValueError, match="PDSERVE_KV_NIXL_READS must be 1 or 0"):
        worker_options()


def test_the_mode_reaches_the_transfer_config(monkeypatch):
    monkeypatch.delenv(NIXL_READS_ENV, raising=False)
    for argv, reads in (((), True), (("--no-kv-nixl-reads",), False)):
        o = worker_options(*argv)
        assert o.lease.transfer_config(nixl_reads=o.kv_nixl_reads).nixl_reads is reads


@pytest.mark.parametrize("argv, passed", [
    ((), ()), (("--no-kv-nixl-reads",), ("--no-kv-nixl-reads",)),
    (("--kv-nixl-reads",), ("--kv-nixl-reads",))])
def test_pdserve_up_passes_the_flag_to_every_worker(argv, passed):
    p = argparse.ArgumentParser()
    cli._add_up(p.add_subparsers(dest="cmd").add_parser("up"))
    a = p.parse_args(["up", *argv])
    assert tuple(x for x in cli._tier_worker_args(a) if "nixl-reads" in x) == passed
