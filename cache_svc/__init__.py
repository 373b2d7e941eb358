"""KVCache service: stores KV snapshots of preempted requests in a memory tier
that spills to a disk tier. The core (`store`, `disk`, `ingest`) is plain
Python; `server` is the only module that speaks gRPC."""
