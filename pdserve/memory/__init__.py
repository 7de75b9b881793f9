from pdserve.memory.checkpoint_pool import GdnCheckpointPool
from pdserve.memory.host_tier import HostTier
from pdserve.memory.kv_pool import KvPagePool
from pdserve.memory.state_pool import GdnStatePool

__all__ = ["GdnCheckpointPool", "GdnStatePool", "HostTier", "KvPagePool"]
