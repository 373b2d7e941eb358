"""What the services share: gRPC plumbing (rpc_server: a service's server;
rpc_connections: channels and per-connection limits; rpc_errors: the domain
error <-> status mapping; security), flags from the environment (settings),
tracing and metrics (telemetry, metrics), process tuning (malloc_tuning), and
the domain every service agrees on: ids, sampling, the KV layout, units,
proto conversions (wire) and tokenizers.

Imports kvstash.errors, kvstash.v1 and itself, never a service, the cache SDK,
the users' client or the launcher. ids, sampling, layout and units import only
the standard library and kvstash.errors: the scheduler core may use them
(tests/test_boundaries.py holds these rules).
"""
