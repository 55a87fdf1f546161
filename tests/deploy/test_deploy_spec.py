"""The deployment schema: one set of fields read from a YAML file, from `pdserve ray up`'s
flags and from Python, validated with the file, field (and flag) named; every field has a flag;
the example deployment files load. No Ray needed."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from pathlib import Path

import pytest

from pdserve.deploy import flags, schema
from pdserve.deploy.autoscale import AutoscaleConfig, ScaleRule
from pdserve.deploy.cli import add_arguments, up_spec
from pdserve.deploy.spec import PoolSpec, RayClusterSpec, RouterSpec, load_spec
from pdserve.deploy.status import DeploymentStatus, Event, ProcessStatus

ROOT = Path(__file__).resolve().parents[2]
URL = "redis://:pw@h:6379/0"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    return path


def up(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["up", *argv])


def test_a_file_says_only_what_differs_and_sections_keep_their_defaults(tmp_path):
    path = write(tmp_path, """
model: /models/llama
decode: {replicas: 4, tp: 2, gpus_per_rank: 1, resources: {decode_node: 1}}
router: {replicas: 2, port: 0}
autoscale: {decode: {max_replicas: 12}}
stop_grace_s: 50
""")
    spec = load_spec(path, environ={"PDSERVE_REDIS_URL": URL})
    assert spec.redis_url == URL  # from the environment: no password in the file
    assert spec.decode == PoolSpec("decode", replicas=4, tp=2, gpus_per_rank=1,
                                   resources={"decode_node": 1.0})
    assert spec.prefill == PoolSpec("prefill")
    assert spec.router == RouterSpec(replicas=2, port=0)
    default = AutoscaleConfig()
    # The decode rule keeps decode's own thresholds, not ScaleRule's generic ones.
    assert spec.autoscale.decode == dataclasses.replace(default.decode, max_replicas=12)
    assert spec.autoscale.prefill == default.prefill
    assert spec.stop_grace_s == 50.0 and spec.replicas() == {"router": 2, "prefill": 1,
                                                              "decode": 4}


@pytest.mark.parametrize("text, message", [
    ("model: /m\ndecode: {replica: 2}\n", r"deploy.yaml: decode.replica: unknown field of "
                                          r"PoolSpec \(did you mean 'replicas'\?\)"),
    ("model: /m\ndecode: {replicas: two}\n", r"decode.replicas: expected an integer, got str"),
    ("model: /m\ndecode: {replicas: true}\n", r"decode.replicas: expected an integer"),
    ("model: /m\ndecode: {worker_args: --dtype}\n", r"decode.worker_args: expected a list"),
    ("model: /m\nprefill: {tp: 0}\n", r"prefill: PoolSpec\(prefill\).tp must be > 0"),
    ("decode: {}\n", r"model: missing"),
    ("model: /m\nrouter: {port: 70000}\n", r"router: RouterSpec.port must be 0..65535"),
    ("model: /m\nautoscale: {prefill: {low: 5000}}\n", r"low \(5000.0\) must be < high"),
    ("- a list\n", r"expected a mapping"),
])
def test_mistakes_name_the_file_and_the_field(tmp_path, text, message):
    with pytest.raises(schema.SchemaError, match=message):
        load_spec(write(tmp_path, text), environ={"PDSERVE_REDIS_URL": URL})


def test_no_redis_url_anywhere_is_refused_saying_where_it_comes_from(tmp_path):
    with pytest.raises(schema.SchemaError, match="PDSERVE_REDIS_URL"):
        load_spec(write(tmp_path, "model: /m\n"), environ={})


def test_null_router_means_pools_only(tmp_path):
    spec = load_spec(write(tmp_path, "model: /m\nrouter: null\n"),
                     environ={"PDSERVE_REDIS_URL": URL})
    assert spec.router is None and spec.replicas()["router"] == 0


def test_flags_override_the_file_and_shared_pool_flags_yield_to_per_pool_ones(tmp_path):
    path = write(tmp_path, "model: /m\ndecode: {replicas: 4, tp: 2}\nprefill: {tp: 2}\n")
    spec = up_spec(up("-f", str(path), "--redis", URL, "--decode", "6", "--gpus-per-rank", "1",
                      "--prefill-gpus-per-rank", "2", "--worker-arg=--dtype=bfloat16",
                      "--env", "OMP_NUM_THREADS=4", "--name", "blue"))
    assert (spec.decode.replicas, spec.decode.tp, spec.decode.gpus_per_rank) == (6, 2, 1.0)
    assert (spec.prefill.tp, spec.prefill.gpus_per_rank) == (2, 2.0)
    assert spec.decode.worker_args == ("--dtype=bfloat16",) == spec.prefill.worker_args
    assert spec.env == {"OMP_NUM_THREADS": "4"} and spec.name == "blue"
    assert spec.controller_name == "blue-controller"


def test_autoscale_flags_set_the_rules_and_need_autoscaling_on():
    spec = up_spec(up("--model", "/m", "--redis", URL, "--autoscale", "--prefill", "2",
                      "--prefill-max", "3", "--decode-high", "0.9", "--autoscale-period", "5"))
    default = AutoscaleConfig()
    assert (spec.autoscale.prefill.min_replicas, spec.autoscale.prefill.max_replicas) == (1, 3)
    assert spec.autoscale.prefill.high == default.prefill.high
    assert spec.autoscale.decode.high == 0.9 and spec.autoscale.period_s == 5.0
    assert up_spec(up("--model", "/m", "--redis", URL)).autoscale is None
    assert up_spec(up("--model", "/m", "--redis", URL, "--autoscale")).autoscale == default


@pytest.mark.parametrize("argv, named", [
    (["--prefill-max", "4"], "--prefill-max"),  # without --autoscale: it would do nothing
    (["--autoscale", "--decode-min", "0"], "--decode-min"),
    (["--autoscale", "--prefill-min", "3", "--prefill-max", "2"], "--prefill-min"),
    (["--autoscale", "--decode", "9"], "--decode"),
    (["--autoscale", "--autoscale-period", "0"], "--autoscale-period"),
    (["--decode-tp", "0"], "--decode-tp"),
    (["--stop-grace", "10"], "--stop-grace"),
    (["--drain-timeout", "60"], "--drain-timeout"),
])
def test_settings_that_cannot_work_are_refused_naming_the_flag(argv, named):
    with pytest.raises(ValueError) as err:
        up_spec(up("--model", "/m", "--redis", URL, *argv))
    assert named in flags.explain(str(err.value))


def _leaf_fields(cls: type, prefix: str = "") -> set[str]:
    """Dotted paths of every settable scalar / list / mapping field of the schema."""
    out: set[str] = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or \
            [hints[f.name]]
        if dataclasses.is_dataclass(inner[0]):
            out |= _leaf_fields(inner[0], f"{prefix}{f.name}.")
        elif f.name != "role":  # a pool's role is its section's name
            out.add(prefix + f.name)
    return out


def test_every_setting_of_the_schema_has_its_flag():
    covered = {path for f in flags.ALL for path in f.paths}
    missing = _leaf_fields(RayClusterSpec) - covered - {"name"}  # --name is a common flag
    assert not missing, f"settings without a `pdserve ray up` flag: {sorted(missing)}"
    assert not covered - _leaf_fields(RayClusterSpec), "flags for fields that do not exist"
    # ... and the CLI really has each one.
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    help_text = parser._subparsers._group_actions[0].choices["up"].format_help()
    for f in flags.ALL:
        assert f.flag in help_text, f.flag


def test_every_field_of_the_schema_has_a_docstring():
    import inspect

    from pdserve.deploy import spec as spec_module

    source = inspect.getsource(spec_module) + inspect.getsource(
        __import__("pdserve.deploy.autoscale", fromlist=["x"]))
    for cls in (PoolSpec, RouterSpec, RayClusterSpec, AutoscaleConfig, ScaleRule):
        body = source[source.index(f"class {cls.__name__}"):]
        for f in dataclasses.fields(cls):
            decl = body.index(f"    {f.name}: ")
            after = body[decl:].split("\n", 2)
            assert after[1].strip().startswith('"""') or \
                (len(after) > 2 and '"""' in after[1]), f"{cls.__name__}.{f.name}"


def test_the_spec_and_status_cross_as_plain_data_and_come_back_equal():
    spec = RayClusterSpec(model="/m", redis_url=URL, host="10.0.0.2",
                          prefill=PoolSpec("prefill", tp=2, resources={"prefill_node": 1},
                                           worker_args=("--dtype", "bfloat16")),
                          router=RouterSpec(args=("--routing", "kv")),
                          autoscale=AutoscaleConfig(period_s=5))
    plain = json.loads(json.dumps(schema.dump(spec)))
    assert schema.load(RayClusterSpec, plain) == spec
    assert schema.load(RayClusterSpec, {**plain, "router": None}).router is None
    st = DeploymentStatus("d", {"router": 1}, (ProcessStatus("router-0", "router", "ready",
                                                             gpus=("0",)),),
                          (Event(1.0, "x"),))
    assert schema.load(DeploymentStatus, json.loads(json.dumps(schema.dump(st)))) == st


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "deploy" / "ray").glob("*.yaml")))
def test_the_example_deployment_files_load(name):
    spec = load_spec(ROOT / "deploy" / "ray" / name, environ={"PDSERVE_REDIS_URL": URL})
    assert spec.model
