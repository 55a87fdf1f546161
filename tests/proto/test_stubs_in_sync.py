"""The committed stubs in pdserve/proto/gen are exactly what the current .proto sources generate."""

import shutil
from pathlib import Path

import pytest

from pdserve.proto import regen


def test_committed_stubs_match_the_proto_sources():
    problems = regen.check(regen.DEFAULT_PROTO_DIR, regen.DEFAULT_OUT_DIR)
    assert problems == [], "stubs out of date; run `python -m pdserve.proto.regen`:\n" + "\n".join(
        problems
    )


def test_generation_is_deterministic(tmp_path: Path):
    regen.generate(regen.DEFAULT_PROTO_DIR, tmp_path / "a")
    regen.generate(regen.DEFAULT_PROTO_DIR, tmp_path / "b")
    first, second = regen.read_tree(tmp_path / "a"), regen.read_tree(tmp_path / "b")
    assert first and first == second


def _committed_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "gen"
    shutil.copytree(regen.DEFAULT_OUT_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_check_reports_an_edited_stub_with_a_diff(tmp_path: Path):
    gen = _committed_copy(tmp_path)
    stub = gen / "pdserve" / "v1" / "pdserve_pb2.pyi"
    stub.write_text(stub.read_text() + "EDITED = 1\n")
    problems = regen.check(regen.DEFAULT_PROTO_DIR, gen)
    assert len(problems) == 1
    assert problems[0].startswith("differs: pdserve/v1/pdserve_pb2.pyi")
    assert "-EDITED = 1" in problems[0]


def test_check_reports_missing_and_stale_files(tmp_path: Path):
    gen = _committed_copy(tmp_path)
    (gen / "pdserve" / "worker" / "v1" / "worker_pb2_grpc.py").unlink()
    (gen / "pdserve" / "v1" / "old_pb2.py").write_text("# left over\n")
    problems = regen.check(regen.DEFAULT_PROTO_DIR, gen)
    assert problems == [
        "missing: pdserve/worker/v1/worker_pb2_grpc.py",
        "stale (not generated any more): pdserve/v1/old_pb2.py",
    ]


def test_check_cli_exits_1_on_drift_and_0_when_in_sync(tmp_path: Path, capsys):
    gen = _committed_copy(tmp_path)
    args = ["--check", "--proto-dir", str(regen.DEFAULT_PROTO_DIR), "--out-dir", str(gen)]
    assert regen.main(args) == 0
    (gen / "pdserve" / "v1" / "pdserve_pb2.py").write_text("# truncated\n")
    assert regen.main(args) == 1
    assert "differs: pdserve/v1/pdserve_pb2.py" in capsys.readouterr().out


def test_write_replaces_the_tree_and_removes_stale_files(tmp_path: Path):
    gen = _committed_copy(tmp_path)
    (gen / "pdserve" / "v1" / "old_pb2.py").write_text("# left over\n")
    regen.write(regen.DEFAULT_PROTO_DIR, gen)
    assert regen.check(regen.DEFAULT_PROTO_DIR, gen) == []


def test_write_refuses_to_replace_a_directory_it_did_not_generate(tmp_path: Path):
    (tmp_path / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="not a generated stub tree"):
        regen.write(regen.DEFAULT_PROTO_DIR, tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "precious"


def test_rewrite_reroots_only_our_generated_modules():
    modules = regen.generated_modules(["pdserve/v1/pdserve.proto"])
    text = (
        "from google.protobuf import descriptor as _descriptor\n"
        "from pdserve.v1 import pdserve_pb2 as pdserve_dot_v1_dot_pdserve__pb2\n"
        "from pdserve.v1 import other_pb2\n"
        "_builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, 'pdserve.v1.pdserve_pb2', _globals)\n"
    )
    assert regen.rewrite_imports(text, modules) == (
        "from google.protobuf import descriptor as _descriptor\n"
        "from pdserve.proto.gen.pdserve.v1 import pdserve_pb2 as pdserve_dot_v1_dot_pdserve__pb2\n"
        "from pdserve.v1 import other_pb2\n"
        "_builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, "
        "'pdserve.proto.gen.pdserve.v1.pdserve_pb2', _globals)\n"
    )
