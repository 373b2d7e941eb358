"""The cache service's SDK: CacheClient (cache_client; the worker and the
scheduler call the cache through it) over its two paths, the shared arena
(arena_calls) and gRPC streams (streamed_calls); and what its client and its
server both speak: the snapshot chunk codec (chunk_codec) and the shared arena
mapped into the client's process (shared_arena).

Imports kvstash.errors, kvstash.common and kvstash.v1, never a service or the
launcher.
"""
