"""kvpool's opt-in alias for Mooncake's store module.

Installed at site-packages' root with a .pth file, so it runs at every
interpreter start. It does nothing unless ``KVPOOL_AS_MOONCAKE=1``; then
``import mooncake.store`` (and ``from mooncake.store import ...``) give
``kvpool.mooncake``, ``mooncake.async_store`` gives
``kvpool.mooncake_async`` and ``mooncake.mooncake_config`` gives
``kvpool.mooncake_config``, so unmodified programs written for Mooncake run on
kvpool. ``mooncake``'s other modules are not provided. Without the variable,
an installed Mooncake wheel is untouched.
"""

import os
import sys

#: Mooncake's module names and the kvpool modules that stand for them.
_ALIASES = {
    "mooncake.store": "kvpool.mooncake",
    "mooncake.async_store": "kvpool.mooncake_async",
    "mooncake.mooncake_config": "kvpool.mooncake_config",
}


def _install() -> None:
    import importlib
    import importlib.abc
    import importlib.machinery

    class _Package(importlib.abc.Loader):
        """An empty ``mooncake`` package: its submodules come from the finder."""

        def create_module(self, spec):
            return None

        def exec_module(self, module):
            module.__path__ = []
            module.__doc__ = "kvpool's stand-in for Mooncake (KVPOOL_AS_MOONCAKE=1)"

    class _Alias(importlib.abc.Loader):
        """``mooncake.<name>`` is one of kvpool's modules itself."""

        def __init__(self, target):
            self.target = target

        def create_module(self, spec):
            return importlib.import_module(self.target)

        def exec_module(self, module):
            pass

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname == "mooncake":
                return importlib.machinery.ModuleSpec(fullname, _Package(), is_package=True)
            target = _ALIASES.get(fullname)
            if target is not None:
                return importlib.machinery.ModuleSpec(fullname, _Alias(target))
            return None

    sys.meta_path.insert(0, _Finder())


if os.environ.get("KVPOOL_AS_MOONCAKE") == "1":
    _install()
