"""kvpool: a pooled DRAM/NVMe KV-cache store.

``kvpool.Client`` speaks to a kvpool pool; ``kvpool.mooncake`` offers
Mooncake's ``MooncakeDistributedStore`` API on the same pool, and with
``KVPOOL_AS_MOONCAKE=1`` in the environment, ``from mooncake.store import
MooncakeDistributedStore`` gives kvpool's class.

Every call releases the GIL while it waits on the pool. Errors raise
``KvpoolError``, whose ``code`` is kvpool's stable error code (``ERROR_CODES``).
"""

from kvpool._errors import KvpoolError
from kvpool._native import RDMA, Client
from kvpool._native import ERROR_CODES as _ERROR_CODES

#: Every kvpool error name and its code (``KvpoolError.code``).
ERROR_CODES: dict = dict(_ERROR_CODES)

__all__ = ["Client", "KvpoolError", "ERROR_CODES", "RDMA"]
