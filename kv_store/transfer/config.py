"""The transfer engine's configuration: one frozen dataclass shared by sender and receiver."""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_store.transfer.wire import MAX_BATCH_PARTS

BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class TransferConfig:
    """Timeouts, limits and backend choice of one `KVSender` or `KVReceiver`."""

    backend: str = "auto"
    """torch.distributed payload transport: "auto" (NCCL for CUDA tensors, gloo for CPU
    tensors), "gloo" (CUDA tensors are staged through host memory) or "nccl" (CPU tensors are
    rejected). Control messages always travel over gloo. A sender or receiver given a NIXL
    agent moves payloads through NIXL instead, to every receiver that offered a landing pool
    (`KVSender.add_peer`); this choice then covers the others."""

    connect_timeout_s: float = 10.0
    """Longest wait for the TCPStore connection and the pair rendezvous of a new pair."""

    io_timeout_s: float = 30.0
    """Longest one wire operation (sending or receiving one message) may block: a pair whose
    peer stops reading or writing breaks after it."""

    lease_s: float = 60.0
    """Longest lease a transfer may hold, and the lease of one whose caller names none. A
    transfer's lease starts with its first call on the sender; when it ends before the DONE
    marker is on the wire, the sender drops the queued layers and tells the receiver (abort),
    and the receiver, told the lease's remainder in every header, gives up at the same time.
    Workers name every lease (`pdserve.serving.kv_lease.LeaseConfig`)."""

    max_pairs: int = 64
    """Most pair groups this process keeps open; the least recently used idle pair is closed to
    make room, and a new pair is refused when none is idle."""

    idle_timeout_s: float = 60.0
    """A pair with nothing queued and no transfer in flight for this long is closed cleanly."""

    close_timeout_s: float = 2.0
    """Grace for a clean close handshake and for joining threads before a pair is torn down."""

    max_message_bytes: int = 1 << 30
    """Largest payload tensor accepted in one layer message (guards against corrupt headers)."""

    history_size: int = 4096
    """How many finished requests are remembered for `state()` and to drop late messages."""

    poll_interval_s: float = 0.02
    """Tick of the background threads (accept loop, deadlines, idle checks)."""

    cuda_device: int | None = None
    """CUDA device that NCCL pairs use on the receiver (None: the device that is current in the
    thread calling `KVReceiver.start()`)."""

    host: str = ""
    """Sender: the local address its gloo device listens on for a pair ("", or a wildcard:
    the address this machine uses to reach the receiver). A worker passes its `--host`, so
    nothing it opens listens on another interface."""

    nixl_pool_bytes: int = 256 << 20
    """Receiver with a NIXL agent: bytes of its landing pool, registered once, into which
    senders write payloads before their LAYER header (`nixl_path`): full windows for four
    pairs at the defaults (huge pages, mapped lazily: a slot costs memory once written)."""

    nixl_slot_bytes: int = 4 << 20
    """Size of one landing slot; a larger payload is sent in several chunks of whole
    blocks (a single block larger than a slot travels inline over gloo)."""

    nixl_slots_per_pair: int = 16
    """Slots a receiver grants each NIXL pair (fewer when the pool runs low; none: that
    pair's payloads travel inline): the pair's window. A message takes at most half of it
    (`coalesce`), so a sender writes one while the receiver copies another out; 16 lets
    eight 3 MiB layers share a message (measured in `docs/perf.md`: 8 slots gave ~10% less
    with the credit counter, 4 about 30% less before it)."""

    nixl_reads: bool = True
    """Sender with a NIXL agent: a pair to a receiver on this host offers slots of this
    process's staging pool (`nixl_pool_bytes`, registered once on huge pages) for the
    receiver to read straight into its cache: one copy instead of two (`nixl_read`; 1.66x
    the landing-pool writes in `bench/transfer_bench.py`). False (a worker's
    `--no-kv-nixl-reads`): every NIXL pair writes into the receiver's landing pool, as
    pairs across hosts always do."""

    coalesce_max_parts: int = 8
    """Sender: most LAYER parts one message carries when several are queued at once (wire
    `BATCH`, `coalesce`); a part alone goes alone at once. 1: one message per part, as
    before wire version 7 (the benchmarks' baseline). NCCL pairs always send one per
    message."""

    auth_key: bytes | None = field(default=None, repr=False)
    """KV key derived from the cluster secret (`InternalSecurity.kv_key`): pairs are opened
    only between ends that hold it and every header is sealed (`auth`). None = open pairs
    (a receiver without a key accepts any sender; one with a key refuses unsigned hellos)."""

    def __post_init__(self) -> None:
        if self.auth_key is not None and len(self.auth_key) < 16:
            raise ValueError("TransferConfig.auth_key must be at least 16 bytes")
        if self.backend not in BACKENDS:
            raise ValueError(
                f"TransferConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        for name in (
            "connect_timeout_s", "io_timeout_s", "lease_s", "idle_timeout_s",
            "close_timeout_s", "poll_interval_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"TransferConfig.{name} must be a positive number, got {value!r}")
        for name in ("max_pairs", "max_message_bytes", "history_size", "nixl_pool_bytes",
                     "nixl_slot_bytes", "nixl_slots_per_pair", "coalesce_max_parts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TransferConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.nixl_reads, bool):
            raise ValueError(f"TransferConfig.nixl_reads must be a bool, got "
                             f"{self.nixl_reads!r}")
        if self.coalesce_max_parts > MAX_BATCH_PARTS:
            raise ValueError(f"TransferConfig.coalesce_max_parts must be at most "
                             f"{MAX_BATCH_PARTS}, got {self.coalesce_max_parts}")
        if self.nixl_slot_bytes > self.nixl_pool_bytes:
            raise ValueError("TransferConfig.nixl_slot_bytes must not exceed nixl_pool_bytes")
        if self.cuda_device is not None and (
            not isinstance(self.cuda_device, int) or self.cuda_device < 0
        ):
            raise ValueError(
                f"TransferConfig.cuda_device must be None or >= 0, got {self.cuda_device!r}")
