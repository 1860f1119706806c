"""kvpool's opt-in alias for Mooncake's store module.

Installed at site-packages' root with a .pth file, so it runs at every
interpreter start. It does nothing unless ``KVPOOL_AS_MOONCAKE=1``; then
``import mooncake.store`` (and ``from mooncake.store import ...``) give
``kvpool.mooncake``, so unmodified programs written for Mooncake run on
kvpool. ``mooncake``'s other modules are not provided. Without the variable,
an installed Mooncake wheel is untouched.
"""

import os
import sys


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
        """``mooncake.store`` is the module ``kvpool.mooncake`` itself."""

        def create_module(self, spec):
            return importlib.import_module("kvpool.mooncake")

        def exec_module(self, module):
            pass

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname == "mooncake":
                return importlib.machinery.ModuleSpec(fullname, _Package(), is_package=True)
            if fullname == "mooncake.store":
                return importlib.machinery.ModuleSpec(fullname, _Alias())
            return None

    sys.meta_path.insert(0, _Finder())


if os.environ.get("KVPOOL_AS_MOONCAKE") == "1":
    _install()
