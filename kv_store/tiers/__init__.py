"""Lower KV tiers below the device pool: pinned host memory and SSD segment files.

    device pool ──evict──► HostStore ──evict──► SSDStore ──evict──► gone
         ▲                     │                    │
         └──── promote (load, when faster than recompute: `policy.plan_load`) ◄──┘

Between steps, the blocks next in line for device eviction are copied to host ahead of time
(`TierManager.demote_ahead`), so their eviction later costs no copy.

`TierManager` is the only object the engine talks to (with tensor parallelism, through
`pdserve.engine.tp.tiers.MirroredTiers`, which replays it on every rank); the stores know
nothing of the device.
"""

from kv_store.tiers.host import HostStore
from kv_store.tiers.manager import TierManager
from kv_store.tiers.policy import BandwidthModel, plan_load, should_load
from kv_store.tiers.ssd import SSDStore

__all__ = ["BandwidthModel", "HostStore", "SSDStore", "TierManager", "plan_load", "should_load"]
