"""``BufferHandle``: what ``get_buffer`` returns.

A ``bytearray`` holding the value (its own copy), with Mooncake's ``ptr()``
and ``size()``. Being a bytearray, it has the buffer protocol (1-D, bytes,
writable: ``memoryview(h)``, ``numpy.frombuffer(h, ...)``) on every Python
the one abi3 wheel installs on, 3.10 included.
"""

from __future__ import annotations

import ctypes

__all__ = ["BufferHandle"]


class BufferHandle(bytearray):
    """A value read by ``get_buffer``; ``ptr()`` is valid until it is resized."""

    __slots__ = ()

    def ptr(self) -> int:
        """The address of the bytes (0 when empty)."""
        if not self:
            return 0
        return ctypes.addressof(ctypes.c_char.from_buffer(self))

    def size(self) -> int:
        """The number of bytes."""
        return len(self)

    def __repr__(self) -> str:
        return f"BufferHandle(ptr={self.ptr():#x}, size={self.size()})"
