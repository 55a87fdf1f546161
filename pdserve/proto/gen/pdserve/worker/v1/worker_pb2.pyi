from pdserve.proto.gen.pdserve.v1 import pdserve_pb2 as _pdserve_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVEndpoint(_message.Message):
    __slots__ = ("address", "tp_rank", "tp_size", "nixl")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    address: str
    tp_rank: int
    tp_size: int
    nixl: bytes
    def __init__(self, address: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., nixl: _Optional[bytes] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "seed", "local_prefill", "deadline_unix_s", "kv_source", "generated_token_ids", "n")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _pdserve_pb2.SamplingParams
    seed: int
    local_prefill: bool
    deadline_unix_s: float
    kv_source: KVSource
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    n: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_pdserve_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., local_prefill: _Optional[bool] = ..., deadline_unix_s: _Optional[float] = ..., kv_source: _Optional[_Union[KVSource, _Mapping]] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ...) -> None: ...

class KVSource(_message.Message):
    __slots__ = ("address", "blocks")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    address: str
    blocks: int
    def __init__(self, address: _Optional[str] = ..., blocks: _Optional[int] = ...) -> None: ...

class DecodeReady(_message.Message):
    __slots__ = ("cached_blocks", "block_ids", "endpoints", "kv_lease_s", "kv_ticket")
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    KV_LEASE_S_FIELD_NUMBER: _ClassVar[int]
    KV_TICKET_FIELD_NUMBER: _ClassVar[int]
    cached_blocks: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    endpoints: _containers.RepeatedCompositeFieldContainer[KVEndpoint]
    kv_lease_s: float
    kv_ticket: bytes
    def __init__(self, cached_blocks: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., endpoints: _Optional[_Iterable[_Union[KVEndpoint, _Mapping]]] = ..., kv_lease_s: _Optional[float] = ..., kv_ticket: _Optional[bytes] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("token_ids", "logprobs", "prompt_logprobs", "index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_pdserve_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_pdserve_pb2.TokenLogprob]
    index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_pdserve_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_pdserve_pb2.TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class DecodeFinished(_message.Message):
    __slots__ = ("reason", "prompt_tokens", "completion_tokens", "cached_tokens", "index")
    REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    reason: _pdserve_pb2.FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    index: int
    def __init__(self, reason: _Optional[_Union[_pdserve_pb2.FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("ready", "tokens", "finished")
    READY_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ready: DecodeReady
    tokens: TokenBatch
    finished: DecodeFinished
    def __init__(self, ready: _Optional[_Union[DecodeReady, _Mapping]] = ..., tokens: _Optional[_Union[TokenBatch, _Mapping]] = ..., finished: _Optional[_Union[DecodeFinished, _Mapping]] = ...) -> None: ...

class KVTarget(_message.Message):
    __slots__ = ("endpoints", "block_ids", "skip_blocks", "lease_s", "kv_ticket")
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    KV_TICKET_FIELD_NUMBER: _ClassVar[int]
    endpoints: _containers.RepeatedCompositeFieldContainer[KVEndpoint]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_blocks: int
    lease_s: float
    kv_ticket: bytes
    def __init__(self, endpoints: _Optional[_Iterable[_Union[KVEndpoint, _Mapping]]] = ..., block_ids: _Optional[_Iterable[int]] = ..., skip_blocks: _Optional[int] = ..., lease_s: _Optional[float] = ..., kv_ticket: _Optional[bytes] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "seed", "target", "deadline_unix_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _pdserve_pb2.SamplingParams
    seed: int
    target: KVTarget
    deadline_unix_s: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_pdserve_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., target: _Optional[_Union[KVTarget, _Mapping]] = ..., deadline_unix_s: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("token_id", "logprob", "cached_tokens", "kv_bytes", "queue_s", "compute_s", "prompt_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: _pdserve_pb2.TokenLogprob
    cached_tokens: int
    kv_bytes: int
    queue_s: float
    compute_s: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_pdserve_pb2.TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[_Union[_pdserve_pb2.TokenLogprob, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., queue_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_pdserve_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("request_id", "block_hashes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, request_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("blocks_promoted",)
    BLOCKS_PROMOTED_FIELD_NUMBER: _ClassVar[int]
    blocks_promoted: int
    def __init__(self, blocks_promoted: _Optional[int] = ...) -> None: ...

class PushKVRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "start_block", "end_block", "endpoints", "block_ids", "hash_extra", "kv_ticket")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    END_BLOCK_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    HASH_EXTRA_FIELD_NUMBER: _ClassVar[int]
    KV_TICKET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    start_block: int
    end_block: int
    endpoints: _containers.RepeatedCompositeFieldContainer[KVEndpoint]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    hash_extra: bytes
    kv_ticket: bytes
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., start_block: _Optional[int] = ..., end_block: _Optional[int] = ..., endpoints: _Optional[_Iterable[_Union[KVEndpoint, _Mapping]]] = ..., block_ids: _Optional[_Iterable[int]] = ..., hash_extra: _Optional[bytes] = ..., kv_ticket: _Optional[bytes] = ...) -> None: ...

class PushKVResponse(_message.Message):
    __slots__ = ("blocks_sent", "kv_bytes")
    BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    blocks_sent: int
    kv_bytes: int
    def __init__(self, blocks_sent: _Optional[int] = ..., kv_bytes: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("kv_snapshot", "take_kv_events")
    KV_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    TAKE_KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    kv_snapshot: bool
    take_kv_events: bool
    def __init__(self, kv_snapshot: _Optional[bool] = ..., take_kv_events: _Optional[bool] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "num_running", "num_waiting", "queued_prefill_tokens", "kv_blocks_total", "kv_blocks_used", "kv_blocks_cached", "counters", "kv_events", "step_model", "draining")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    STEP_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    counters: _containers.ScalarMap[str, float]
    kv_events: bytes
    step_model: StepModel
    draining: bool
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., counters: _Optional[_Mapping[str, float]] = ..., kv_events: _Optional[bytes] = ..., step_model: _Optional[_Union[StepModel, _Mapping]] = ..., draining: _Optional[bool] = ...) -> None: ...

class StepModel(_message.Message):
    __slots__ = ("step_base_s", "step_per_token_s", "samples")
    STEP_BASE_S_FIELD_NUMBER: _ClassVar[int]
    STEP_PER_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    step_base_s: float
    step_per_token_s: float
    samples: int
    def __init__(self, step_base_s: _Optional[float] = ..., step_per_token_s: _Optional[float] = ..., samples: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "model_id", "block_size", "tp_size", "max_model_len", "endpoints", "api_version", "hash_extra", "max_num_seqs", "max_num_batched_tokens", "kv_bytes_per_block")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    HASH_EXTRA_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    model_id: str
    block_size: int
    tp_size: int
    max_model_len: int
    endpoints: _containers.RepeatedCompositeFieldContainer[KVEndpoint]
    api_version: int
    hash_extra: bytes
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_bytes_per_block: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., model_id: _Optional[str] = ..., block_size: _Optional[int] = ..., tp_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., endpoints: _Optional[_Iterable[_Union[KVEndpoint, _Mapping]]] = ..., api_version: _Optional[int] = ..., hash_extra: _Optional[bytes] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., kv_bytes_per_block: _Optional[int] = ...) -> None: ...
