"""Mooncake's own store tests, vendored unchanged, and kvpool's runner for
them (``run_upstream.py``; README.md says how).

This folder is a package only so that its ``conftest.py`` is imported as
``mooncake_upstream.conftest``: a second top-level ``conftest`` module would
replace ``python/tests/conftest.py`` in ``sys.modules``, and the tests there
that ``from conftest import ...`` would fail to import.
"""
