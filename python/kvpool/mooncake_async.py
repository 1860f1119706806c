"""Mooncake's ``mooncake.async_store``: the store with an ``async_`` form of
every method.

``MooncakeDistributedStoreAsync`` is :class:`kvpool.mooncake.MooncakeDistributedStore`;
``await store.async_put(key, value)`` (any method name after ``async_``)
runs the blocking call on the event loop's default executor, so the loop
keeps running while kvpool moves the bytes (every call releases the GIL).
With ``KVPOOL_AS_MOONCAKE=1`` it is also ``mooncake.async_store``.
"""

import asyncio
import functools

from kvpool.mooncake import MooncakeDistributedStore

__all__ = ["MooncakeDistributedStoreAsync"]

_PREFIX = "async_"


class MooncakeDistributedStoreAsync(MooncakeDistributedStore):
    """The store, with ``async_<method>`` coroutine functions."""

    def __getattr__(self, name):
        # Called only for names the class and instance do not have.
        if not name.startswith(_PREFIX) or len(name) == len(_PREFIX):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        method = getattr(self, name[len(_PREFIX):], None)
        if not callable(method):
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r} "
                f"(and no method {name[len(_PREFIX):]!r} to run asynchronously)")

        @functools.wraps(method)
        async def call(*args, **kwargs):
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, functools.partial(method, *args, **kwargs))

        return call
