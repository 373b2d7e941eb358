"""KVCache service: stores KV snapshots of preempted requests in a memory tier
that spills to a disk tier.

The core is plain Python and never imports grpc: `store` (puts, deletes, TTL,
stats) and `reads` (gets) over `tiers` (the listing, the disk tier, making
room), which uses `memory_tier`, `eviction` (victim choice), `disk`,
`buffers`, `arena` and `background` (I/O threads and tasks); `ingest`
assembles one put. The gRPC edge is `server` (the servicer's small calls, its
registration, the running server), `stream_calls` (PutSnapshot, GetSnapshot,
paced by `put_stream` and `limiter`), `arena_calls` (the co-located path)
and `convert` (protos <-> domain types)."""
