"""kvstash: a KV-cache-aware control plane for LLM serving."""

from __future__ import annotations

__all__ = ["Client", "GenerateResult", "TokenDelta"]


def __getattr__(name: str):  # lazy: `import kvstash.errors` must not pull grpc
    if name in __all__:
        from kvstash import client

        return getattr(client, name)
    raise AttributeError(name)
