"""The .proto contracts: documented, versioned, and shaped the way router and workers rely on."""

from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from pdserve.proto import pb, pb_grpc, regen, worker_pb, worker_pb_grpc

# descriptor.proto field numbers used in SourceCodeInfo paths.
MESSAGE, ENUM, SERVICE = 4, 5, 6
FIELD, NESTED, ENUM_VALUE, METHOD = 2, 3, 2, 2


@pytest.fixture(scope="module")
def descriptor_set(tmp_path_factory) -> descriptor_pb2.FileDescriptorSet:
    out = tmp_path_factory.mktemp("descriptors") / "set.pb"
    protos = regen.find_protos(regen.DEFAULT_PROTO_DIR)
    args = [f"--proto_path={regen.DEFAULT_PROTO_DIR}", "--include_source_info"]
    args += [f"--descriptor_set_out={out}", *(str(regen.DEFAULT_PROTO_DIR / p) for p in protos)]
    regen.protoc(args)
    return descriptor_pb2.FileDescriptorSet.FromString(Path(out).read_bytes())


def _declarations(file: descriptor_pb2.FileDescriptorProto):
    """(SourceCodeInfo path, readable name) of every message, field, enum, value, rpc."""

    def message(msg, path, prefix):
        yield path, prefix + msg.name
        for i, field in enumerate(msg.field):
            yield (*path, FIELD, i), f"{prefix}{msg.name}.{field.name}"
        for i, nested in enumerate(msg.nested_type):
            if not nested.options.map_entry:
                yield from message(nested, (*path, NESTED, i), f"{prefix}{msg.name}.")

    for i, msg in enumerate(file.message_type):
        yield from message(msg, (MESSAGE, i), "")
    for i, enum in enumerate(file.enum_type):
        yield (ENUM, i), enum.name
        for j, value in enumerate(enum.value):
            yield (ENUM, i, ENUM_VALUE, j), value.name
    for i, service in enumerate(file.service):
        yield (SERVICE, i), service.name
        for j, method in enumerate(service.method):
            yield (SERVICE, i, METHOD, j), f"{service.name}.{method.name}"


def test_every_declaration_has_a_comment(descriptor_set):
    undocumented = []
    for file in descriptor_set.file:
        comments = {
            tuple(loc.path): (loc.leading_comments + loc.trailing_comments).strip()
            for loc in file.source_code_info.location
        }
        undocumented += [
            f"{file.name}: {name}" for path, name in _declarations(file) if not comments.get(path)
        ]
    assert undocumented == []


def test_each_file_is_versioned_by_its_package(descriptor_set):
    packages = {file.name: file.package for file in descriptor_set.file}
    assert packages == {
        "pdserve/v1/pdserve.proto": "pdserve.v1",
        "pdserve/worker/v1/worker.proto": "pdserve.worker.v1",
    }
    for name, package in packages.items():
        assert name.removesuffix(Path(name).name).rstrip("/").replace("/", ".") == package


def _method_shapes(service_descriptor):
    return {
        m.name: (m.input_type.name, m.output_type.name, m.server_streaming)
        for m in service_descriptor.methods
    }


def test_public_service_shape():
    assert _method_shapes(pb.DESCRIPTOR.services_by_name["PDServe"]) == {
        "Generate": ("GenerateRequest", "GenerateResponse", True),
        "ListModels": ("ListModelsRequest", "ListModelsResponse", False),
    }
    assert hasattr(pb_grpc, "PDServeStub") and hasattr(pb_grpc, "add_PDServeServicer_to_server")


def test_worker_service_shape():
    assert _method_shapes(worker_pb.DESCRIPTOR.services_by_name["Worker"]) == {
        "Decode": ("DecodeRequest", "DecodeEvent", True),
        "Prefill": ("PrefillRequest", "PrefillResponse", False),
        "Abort": ("AbortRequest", "AbortResponse", False),
        "Prefetch": ("PrefetchRequest", "PrefetchResponse", False),
        "PushKV": ("PushKVRequest", "PushKVResponse", False),
        "GetStats": ("StatsRequest", "WorkerStats", False),
        "GetInfo": ("InfoRequest", "WorkerInfo", False),
    }
    assert hasattr(worker_pb_grpc, "WorkerStub")
    assert hasattr(worker_pb_grpc, "add_WorkerServicer_to_server")


def test_sampling_scalars_distinguish_unset_from_zero():
    params = pb.SamplingParams()
    optional = [
        "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
        "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "logprobs",
    ]  # fmt: skip
    for name in optional:
        assert not params.HasField(name), name
        setattr(params, name, 0)
        assert params.HasField(name), name
    decoded = pb.SamplingParams.FromString(params.SerializeToString())
    assert all(decoded.HasField(name) for name in optional)


def test_worker_messages_reuse_public_types_across_files():
    request = worker_pb.DecodeRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=4),
    )
    event = worker_pb.DecodeEvent(
        finished=worker_pb.DecodeFinished(reason=pb.FINISH_REASON_LENGTH, completion_tokens=4)
    )
    assert worker_pb.DecodeRequest.FromString(request.SerializeToString()) == request
    assert isinstance(request.sampling, pb.SamplingParams)
    assert event.WhichOneof("event") == "finished"
    assert worker_pb.TokenBatch(logprobs=[pb.TokenLogprob(token_id=5)]).logprobs[0].token_id == 5


def test_generated_classes_name_their_real_module():
    assert pb.GenerateRequest.__module__ == "pdserve.proto.gen.pdserve.v1.pdserve_pb2"
    assert worker_pb.WorkerInfo.__module__ == "pdserve.proto.gen.pdserve.worker.v1.worker_pb2"


def test_generate_request_prompt_is_text_or_token_ids():
    by_text = pb.GenerateRequest(text="hello")
    by_ids = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7, 8]))
    assert by_text.WhichOneof("prompt") == "text"
    assert by_ids.WhichOneof("prompt") == "token_ids"
    by_ids.text = "switch"
    assert by_ids.WhichOneof("prompt") == "text" and not by_ids.HasField("token_ids")
