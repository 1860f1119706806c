"""Mooncake's store API on kvpool.

``MooncakeDistributedStore``, ``ReplicateConfig``, ``BufferHandle`` and
``MooncakeHostMemAllocator`` with Mooncake's names, signatures and return
conventions, so that programs written for ``mooncake.store`` (vLLM's
MooncakeStoreConnector, SGLang's HiCache, LMCache's ``mooncakestore://``)
run on a kvpool pool. Errors are Mooncake's negative codes (kvpool's codes
mapped through one table: ``mooncake_code_table()``); a call before
``setup`` returns -600.

``setup`` connects to kvpool's master (``master_server_addr``, host:port);
``global_segment_size > 0`` starts a storage node inside this process that
gives that much of its DRAM to the pool (0: a pure client).
``metadata_server`` is accepted and not needed (kvpool's master holds the
metadata). A kvpool config file named by ``KVPOOL_CONFIG`` tunes the client
(``[client]``) and the embedded node (``[storage]``, ``[runtime]``);
``KVPOOL_SECRET`` is the cluster secret.
"""

from __future__ import annotations

import enum
import logging
import operator
import re

from kvpool import _tensor
from kvpool._buffer import BufferHandle
from kvpool._native import (
    MooncakeHostMemAllocator,
    ObjectDataType,
    ReplicateConfig,
    SoftPinAction,
    _MooncakeStore,
    mooncake_code_table,
)

__all__ = [
    "MooncakeDistributedStore",
    "ReplicateConfig",
    "BufferHandle",
    "MooncakeHostMemAllocator",
    "SoftPinAction",
    "ObjectDataType",
    "mooncake_code_table",
    "ReplicaStatus",
    "ReplicaDescriptor",
    "MemoryDescriptor",
    "DiskDescriptor",
    "Descriptor",
]

# Mooncake exports ObjectDataType's values into the module.
UNKNOWN = ObjectDataType.UNKNOWN
KVCACHE = ObjectDataType.KVCACHE
TENSOR = ObjectDataType.TENSOR
WEIGHT = ObjectDataType.WEIGHT
SAMPLE = ObjectDataType.SAMPLE
ACTIVATION = ObjectDataType.ACTIVATION
GRADIENT = ObjectDataType.GRADIENT
OPTIMIZER_STATE = ObjectDataType.OPTIMIZER_STATE
METADATA = ObjectDataType.METADATA
GENERAL = ObjectDataType.GENERAL

_log = logging.getLogger("kvpool.mooncake")

INVALID_PARAMS = -600
_KIB = 1 << 10
_TIB = 1 << 40
#: Units of Mooncake's size strings (powers of 1024, case-insensitive).
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "t": 1 << 40, "tb": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")
#: Mooncake's default master address in the dict form of ``setup``.
_DEFAULT_MASTER = "127.0.0.1:50051"


def _parse_size(v) -> int | None:
    """Bytes from an int or a string such as "16MB", "16 MB", "1.5 GB",
    "infinite"; None when it is not a size."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v if v >= 0 else None
    s = str(v).strip()
    if s.lower() == "infinite":
        return (1 << 64) - 1
    m = _SIZE.match(s)
    if not m or m.group(2).lower() not in _UNITS:
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _parse_bool(v) -> bool:
    return str(v).strip().lower() in ("1", "true", "yes", "on")


class ReplicaStatus(enum.IntEnum):
    """Mooncake's replica states; kvpool reports only complete replicas."""

    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class Descriptor:
    """Where a memory replica lies: ``size`` bytes at ``buffer_address``
    (kvpool: the offset in its segment) behind ``transport_endpoint`` (the
    storage shard's ``host:port``)."""

    def __init__(self, size: int, buffer_address: int, transport_endpoint: str):
        self.size = size
        self.buffer_address = buffer_address
        self.transport_endpoint = transport_endpoint

    def __repr__(self) -> str:
        return (f"Descriptor(size={self.size}, buffer_address={self.buffer_address}, "
                f"transport_endpoint={self.transport_endpoint!r})")


class MemoryDescriptor:
    """A DRAM replica's ``buffer_descriptor``."""

    def __init__(self, buffer_descriptor: Descriptor):
        self.buffer_descriptor = buffer_descriptor


class DiskDescriptor:
    """An NVMe replica: ``file_path`` names its segment and location
    (``nvme://<segment id>/<location>``; kvpool's tier has no file per
    object), ``object_size`` its bytes."""

    def __init__(self, file_path: str, object_size: int):
        self.file_path = file_path
        self.object_size = object_size


class ReplicaDescriptor:
    """One replica of an object, as ``get_replica_desc`` gives it."""

    def __init__(self, tier: str, size: int, offset: int, endpoint: str, segment: str,
                 local: bool):
        self.status = ReplicaStatus.COMPLETE
        self._tier = tier
        self._local = local
        self._memory = MemoryDescriptor(Descriptor(size, offset, endpoint))
        self._disk = DiskDescriptor(f"nvme://{segment}/{offset:x}", size)

    def is_memory_replica(self) -> bool:
        return self._tier == "memory"

    def is_disk_replica(self) -> bool:
        return self._tier == "disk"

    def is_local_disk_replica(self) -> bool:
        return self._tier == "disk" and self._local

    def get_memory_descriptor(self) -> MemoryDescriptor:
        if not self.is_memory_replica():
            raise RuntimeError("not a memory replica")
        return self._memory

    def get_disk_descriptor(self) -> DiskDescriptor:
        if not self.is_disk_replica():
            raise RuntimeError("not a disk replica")
        return self._disk

    def __repr__(self) -> str:
        return f"ReplicaDescriptor({self._tier}, size={self._memory.buffer_descriptor.size})"


class MooncakeDistributedStore(_MooncakeStore):
    """Mooncake's ``MooncakeDistributedStore`` on kvpool.

    Create it with no arguments, then ``setup(...)`` (seven positional
    arguments and keyword extras, or one dict). Every I/O method releases
    the GIL and may be called from many threads at once.
    """

    def setup(self, *args, **kwargs) -> int:
        """``setup(local_hostname, metadata_server, global_segment_size,
        local_buffer_size, protocol, rdma_devices, master_server_addr,
        engine=None, enable_ssd_offload=False, ssd_offload_path="",
        tenant_id="default", enable_client_http_server=False,
        client_http_port=9300)`` or ``setup(config: dict)``. Returns 0 or a
        negative code."""
        if len(args) == 1 and not kwargs and isinstance(args[0], dict):
            return self._setup_dict(args[0])
        if not args and list(kwargs) == ["config"] and isinstance(kwargs["config"], dict):
            return self._setup_dict(kwargs["config"])
        return _setup_positional(self, *args, **kwargs)

    def get_replica_desc(self, key: str) -> list:
        """The replicas of ``key`` (``ReplicaDescriptor``), ``[]`` when it
        has none that can be read. Holds a read lease on the object, as a
        get does."""
        descs = self._replica_descs([key])[0]
        return [ReplicaDescriptor(*d) for d in descs or []]

    def batch_get_replica_desc(self, keys: list) -> dict:
        """``{key: [ReplicaDescriptor, ...]}`` for the keys that have
        replicas to read; the others are left out, as Mooncake does."""
        keys = list(keys)
        out = {}
        for k, descs in zip(keys, self._replica_descs(keys)):
            if descs:
                out[k] = [ReplicaDescriptor(*d) for d in descs]
        return out

    def alloc_from_mem_pool(self, size: int) -> int:
        """``size`` bytes of shareable host memory (as Mooncake's standalone
        client gives): its address, or 0 when it cannot be had. Not
        registered: ``register_buffer(ptr, size)`` it before pointer calls.
        ``MooncakeHostMemAllocator().free(ptr)`` gives it back; what is not
        given back goes with the process."""
        size = operator.index(size)
        if size <= 0:
            return 0
        try:
            return MooncakeHostMemAllocator().alloc(size)
        except RuntimeError as e:
            _log.warning("alloc_from_mem_pool(%d): %s", size, e)
            return 0

    # Tensors (Mooncake's tensor object format: a 304-byte header, then the
    # bytes; see kvpool._tensor). torch is imported on first use.

    def _write_tensor(self, key, tensor, config, replace: bool) -> int:
        try:
            header, data = _tensor.tensor_parts(tensor)
        except (TypeError, ValueError) as e:
            _log.error("tensor %r: %s", key, e)
            return INVALID_PARAMS
        write = self.upsert_parts if replace else self.put_parts
        return write(key, header, data, config=config)

    def put_tensor(self, key: str, tensor) -> int:
        """Stores a torch tensor (a device tensor is copied to the host
        first). 0 or a negative code (-600 for what is not a tensor of one
        of Mooncake's 15 dtypes, or one with an empty dimension, which
        Mooncake's format has not)."""
        return self._write_tensor(key, tensor, None, False)

    def pub_tensor(self, key: str, tensor, config: ReplicateConfig = None) -> int:
        """``put_tensor`` with a ``ReplicateConfig``."""
        return self._write_tensor(key, tensor, config, False)

    def upsert_tensor(self, key: str, tensor, config: ReplicateConfig = None) -> int:
        """``put_tensor`` that replaces what is stored under ``key``."""
        return self._write_tensor(key, tensor, config, True)

    def batch_put_tensor(self, keys: list, tensors_list: list) -> list:
        """``put_tensor`` of each pair: a code per key."""
        return self._write_tensors(keys, tensors_list, None, False)

    def batch_pub_tensor(self, keys: list, tensors_list: list,
                         config: ReplicateConfig = None) -> list:
        """``pub_tensor`` of each pair: a code per key."""
        return self._write_tensors(keys, tensors_list, config, False)

    def batch_upsert_tensor(self, keys: list, tensors_list: list,
                            config: ReplicateConfig = None) -> list:
        """``upsert_tensor`` of each pair: a code per key."""
        return self._write_tensors(keys, tensors_list, config, True)

    def _write_tensors(self, keys, tensors, config, replace: bool) -> list:
        keys, tensors = list(keys), list(tensors)
        if len(keys) != len(tensors):
            return [INVALID_PARAMS] * len(keys)
        return [self._write_tensor(k, t, config, replace) for k, t in zip(keys, tensors)]

    def get_tensor(self, key: str):
        """The tensor stored under ``key``, on the CPU, or None (a miss, an
        error, or a value that is not a tensor object)."""
        return _tensor_or_none(key, self.get_buffer(key))

    def batch_get_tensor(self, keys: list) -> list:
        """``get_tensor`` of each key: a tensor or None per key."""
        keys = list(keys)
        return [_tensor_or_none(k, b) for k, b in zip(keys, self.batch_get_buffer(keys))]

    def _setup_dict(self, config: dict) -> int:
        cfg = {str(k): str(v) for k, v in config.items()}
        if "local_hostname" not in cfg or "metadata_server" not in cfg:
            _log.warning("setup: the dict needs local_hostname and metadata_server")
            return INVALID_PARAMS
        sizes = {}
        for name in ("global_segment_size", "local_buffer_size"):
            n = _parse_size(cfg.get(name, 16 << 20))
            if n is None:
                _log.warning("setup: %s=%r is not a size", name, cfg.get(name))
                return INVALID_PARAMS
            sizes[name] = n
        return self._setup(
            cfg["local_hostname"],
            sizes["global_segment_size"],
            sizes["local_buffer_size"],
            cfg.get("protocol", "tcp"),
            cfg.get("rdma_devices", ""),
            # LMCache's mooncakestore config calls it master_server_address.
            cfg.get("master_server_addr") or cfg.get("master_server_address") or _DEFAULT_MASTER,
            enable_ssd_offload=_parse_bool(cfg.get("enable_ssd_offload", "false")),
            tenant_id=cfg.get("tenant_id", "default"),
        )

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """Mooncake's standalone client. kvpool needs no resource-owning
        holder: the store connects to the master at ``server_address``
        (host:port) as a pure client. Returns 0 or a negative code."""
        operator.index(mem_pool_size)
        operator.index(local_buffer_size)
        if not isinstance(server_address, str):
            raise TypeError("setup_dummy(): server_address must be a str")
        return self._setup("localhost", 0, local_buffer_size, "tcp", "", server_address)

    def _setup(self, local_hostname, global_segment_size, local_buffer_size, protocol,
               rdma_devices, master_server_addr, enable_ssd_offload=False,
               tenant_id="default") -> int:
        if global_segment_size != 0 and global_segment_size < _KIB:
            _log.warning("setup: global_segment_size must be 0 or at least 1 KiB")
            return INVALID_PARAMS
        if local_buffer_size != 0 and not (_KIB <= local_buffer_size <= _TIB):
            _log.warning("setup: local_buffer_size must be 0 or in [1 KiB, 1 TiB]")
            return INVALID_PARAMS
        if enable_ssd_offload:
            _log.warning("setup: enable_ssd_offload is ignored; a node's NVMe tier is "
                         "[storage.nvme] in the kvpool config (KVPOOL_CONFIG)")
        if tenant_id != "default":
            _log.warning("setup: tenant_id %r is ignored (kvpool has one namespace)", tenant_id)
        return self._setup_native(local_hostname, master_server_addr, global_segment_size,
                                  protocol, rdma_devices)


def _tensor_or_none(key, buf):
    if buf is None:
        return None
    try:
        return _tensor.tensor_of(buf)
    except ValueError as e:
        _log.error("get_tensor %r: not a tensor object: %s", key, e)
        return None


def _setup_positional(self, local_hostname, metadata_server, global_segment_size,
                      local_buffer_size, protocol, rdma_devices, master_server_addr,
                      engine=None, enable_ssd_offload=False, ssd_offload_path="",
                      tenant_id="default", enable_client_http_server=False,
                      client_http_port=9300) -> int:
    for name, v in (("local_hostname", local_hostname), ("metadata_server", metadata_server),
                    ("protocol", protocol), ("rdma_devices", rdma_devices),
                    ("master_server_addr", master_server_addr)):
        if not isinstance(v, str):
            raise TypeError(f"setup(): {name} must be a str, not {type(v).__name__}")
    gss = operator.index(global_segment_size)
    lbs = operator.index(local_buffer_size)
    if gss < 0 or lbs < 0:
        return INVALID_PARAMS
    if engine is not None:
        _log.warning("setup: a Mooncake TransferEngine cannot be shared with kvpool; ignored")
    return self._setup(local_hostname, gss, lbs, protocol, rdma_devices, master_server_addr,
                       enable_ssd_offload=bool(enable_ssd_offload), tenant_id=str(tenant_id))


# TypeError messages name the call as Mooncake's do ("setup() got an
# unexpected keyword argument 'x'"); SGLang retries without that argument.
_setup_positional.__name__ = "setup"
_setup_positional.__qualname__ = "setup"
# 3.11 on name the call by the code's qualified name, 3.10 by its name.
_names = {"co_name": "setup"}
if hasattr(_setup_positional.__code__, "co_qualname"):
    _names["co_qualname"] = "setup"
_setup_positional.__code__ = _setup_positional.__code__.replace(**_names)
del _names
