"""Scheduler service: admission, batching, KV-block accounting, preemption."""
