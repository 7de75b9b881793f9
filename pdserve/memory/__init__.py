from pdserve.memory.kv_pool import KvPagePool
from pdserve.memory.state_pool import GdnStatePool

__all__ = ["GdnStatePool", "KvPagePool"]
