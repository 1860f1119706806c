"""Keeps ``pytest python/tests`` away from the vendored Mooncake files.

They are unittest files that need a pool, ``KVPOOL_AS_MOONCAKE=1`` and the
environment variables Mooncake's CI sets; ``run_upstream.py`` runs them
with all of that (README.md here). Collected by a plain ``pytest`` run they
would fail to import or reach for Mooncake's fixed ports.
"""

collect_ignore_glob = ["test_*.py", "run_upstream.py"]
