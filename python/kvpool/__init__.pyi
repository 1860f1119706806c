"""Type stubs for kvpool (the native module's classes)."""

from types import TracebackType
from typing import Any, Optional, Sequence, Union

from typing_extensions import Buffer

Key = Union[str, bytes]

#: Every kvpool error name and its code.
ERROR_CODES: dict[str, int]
#: Whether this build has RDMA.
RDMA: bool

class KvpoolError(Exception):
    """An error from kvpool, with kvpool's stable code."""

    code: int
    name: str
    message: str
    def __init__(self, code: int, name: str, message: str) -> None: ...

class Client:
    """A connection to a kvpool pool; share one between threads.

    ``options``: keys of kvpool's ``[client]`` config (``timeout_ms``,
    ``connect_timeout_ms``, ``transport``, ``lanes``, ``checksums``, ...) and
    ``secret`` (default ``$KVPOOL_SECRET``)."""

    def __init__(self, master: str = "127.0.0.1:7070", **options: Any) -> None: ...
    @property
    def master(self) -> str: ...
    def put(self, key: Key, value: Buffer, *, replicas: int = 1, soft_pin_ms: int = 0,
            hard_pin: bool = False) -> None:
        """Stores ``value`` under ``key``; a stored key raises ObjectAlreadyExists."""
    def upsert(self, key: Key, value: Buffer, *, replicas: int = 1, soft_pin_ms: int = 0,
               hard_pin: bool = False) -> None:
        """Stores ``value`` under ``key``, replacing what is there (atomically)."""
    def put_from(self, key: Key, buffer: Buffer, *, replicas: int = 1, soft_pin_ms: int = 0,
                 hard_pin: bool = False) -> None:
        """:meth:`put` from a buffer (zero copy from a registered one with RDMA)."""
    def get(self, key: Key) -> Optional[bytes]:
        """The value, or None on a miss."""
    def get_into(self, key: Key, buffer: Buffer) -> Optional[int]:
        """Reads the value into a writable buffer; its length, or None on a miss."""
    def exists(self, key: Key) -> bool: ...
    def remove(self, key: Key, force: bool = False) -> bool:
        """True if removed, False if absent; raises ObjectHasLease under a lease."""
    def remove_all(self, force: bool = False) -> int: ...
    def batch_put(self, keys: Sequence[Key], values: Sequence[Buffer], *, replicas: int = 1,
                  soft_pin_ms: int = 0, hard_pin: bool = False) -> list[Optional[KvpoolError]]:
        """Per key: None (stored) or the error that kept it out."""
    def batch_get(self, keys: Sequence[Key]) -> list[Optional[bytes]]: ...
    def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Buffer]) -> list[Optional[int]]: ...
    def batch_exists(self, keys: Sequence[Key]) -> list[bool]: ...
    def batch_remove(self, keys: Sequence[Key], force: bool = False) -> list[bool]: ...
    def register_buffer(self, buffer: Buffer) -> None:
        """Holds a writable buffer registered for transfers (an RDMA MR when on)."""
    def unregister_buffer(self, buffer: Buffer) -> bool: ...
    def stat(self) -> dict[str, Any]:
        """keys, capacity, used, evictions, evicted_bytes, demotions, promotions, segments."""
    def close(self) -> None: ...
    def __enter__(self) -> "Client": ...
    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> bool: ...
