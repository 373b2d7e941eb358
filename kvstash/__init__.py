"""kvstash: a KV-cache-aware control plane for LLM serving.

This package holds what users import: `Client` (kvstash.client) and the errors
it raises (kvstash.errors). Its subpackages, by audience:

    kvstash.common     what the services share: gRPC plumbing, security,
                       settings, telemetry, metrics, and the domain every
                       service agrees on (ids, sampling, layout, units, wire,
                       tokenizer)
    kvstash.cache_sdk  the cache service's SDK: CacheClient, the chunk codec
                       and the shared arena
    kvstash.launch     what runs a stack: the `kvstash` command, the stack of
                       service processes, the gateway launcher, the demo
    kvstash.v1         generated gRPC code

Who may import whom: tests/test_boundaries.py.
"""

from __future__ import annotations

__all__ = ["Client", "GenerateResult", "TokenDelta"]


def __getattr__(name: str):  # lazy: `import kvstash.errors` must not pull grpc
    if name in __all__:
        from kvstash import client

        return getattr(client, name)
    raise AttributeError(name)
