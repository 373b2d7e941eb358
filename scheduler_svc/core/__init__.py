"""The scheduler's core: requests, blocks, preemption and admission as plain
synchronous Python. It never imports grpc, asyncio, opentelemetry or the
generated protos (tests/test_boundaries.py enforces it): the
engine drives it, and the gRPC edges convert to and from its dataclasses.

    scheduler.py   one step: preempt -> decode -> resume -> prefill; update()
    lifecycle.py   every request's status, queue, blocks and snapshot
    pd.py          P/D disaggregation: hand-offs (prefill), reservations (decode)
    intake.py      a new request's checks and arrival stamp
    preemption.py  victims, offload or recompute, resume order (policy)
    costs.py       offload + restore vs recompute seconds, fitted to measurements
    copy_fit.py    a copy's seconds by its blocks, robust to outliers (costs.py)
    step_fit.py    a step's seconds by its features, robust, none below 0 (costs.py)
    admission.py   chunked prefill and admission under budget and reservation
    prefix_tier.py prompt segments kept in the cache service for every instance
    reservation.py blocks kept back for running decodes (new_token_ratio)
    kv_manager.py  per-request block tables, prefix caching
    block_pool.py  block ids, refcounts, hashes
    kv_events.py   the prefix cache's changes, for cache-aware routers
    invariants.py  what must hold between queues and requests (check_integrity)
    request.py     a request: tokens, progress, blocks, status
    seq.py         a request's work in one step (ScheduledSeq)
    outputs.py     the contracts with the engine: commands, updates, counters, stats
    config.py      SchedulerConfig, validated at construction
"""
