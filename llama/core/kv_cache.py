"""Deprecated module path: the KV cache is llama.core.worker.kv_cache (core/ is grouped by role since December
2026, docs/architecture.md). Importing this path still works and warns; it will be removed in a later release."""

import warnings

from llama.core.worker import kv_cache

warnings.warn("llama.core.kv_cache is deprecated: import from llama.core.worker.kv_cache", DeprecationWarning,
              stacklevel=2)


def __getattr__(name: str):
    return getattr(kv_cache, name)
