"""The worker's Prometheus metrics: step time, batch size, tokens computed and
KV transfers to and from the cache service.

Steps are observed on the compute thread, transfers on the event loop;
prometheus_client's metrics take their own locks, so both are safe.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram

from gpu_worker.runner import SeqWork
from kvstash.common.metrics import TRANSFER_BUCKETS

_PREFIX = "kvstash_worker_"
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def is_decode(seq: SeqWork) -> bool:
    """One token after a cached prefix. The plan does not say which phase a
    sequence is in, so a one-token final prefill chunk counts as decode."""
    return len(seq.token_ids) == 1 and seq.start_pos > 0


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.step_s = Histogram(_PREFIX + "step_seconds", "Compute time of one engine step",
                                buckets=_STEP_BUCKETS, registry=r)
        self.step_sequences = Histogram(_PREFIX + "step_sequences", "Sequences in one step",
                                        buckets=_BATCH_BUCKETS, registry=r)
        self.prefill_tokens = Counter(_PREFIX + "prefill_tokens",
                                      "Prompt (and recomputed) tokens computed", registry=r)
        self.decode_tokens = Counter(_PREFIX + "decode_tokens", "Decode tokens computed",
                                     registry=r)
        self.offload_bytes = Counter(_PREFIX + "offload_bytes",
                                     "KV bytes committed to the cache service", registry=r)
        self.restore_bytes = Counter(_PREFIX + "restore_bytes",
                                     "KV bytes restored from the cache service", registry=r)
        self.offload_s = Histogram(_PREFIX + "offload_seconds",
                                   "Gather plus put of one successful offload",
                                   buckets=TRANSFER_BUCKETS, registry=r)
        self.restore_s = Histogram(_PREFIX + "restore_seconds",
                                   "Get plus scatter of one successful restore",
                                   buckets=TRANSFER_BUCKETS, registry=r)

    def observe_step(self, seqs: Sequence[SeqWork], seconds: float) -> None:
        decode = sum(len(s.token_ids) for s in seqs if is_decode(s))
        self.step_s.observe(seconds)
        self.step_sequences.observe(len(seqs))
        self.decode_tokens.inc(decode)
        self.prefill_tokens.inc(sum(len(s.token_ids) for s in seqs) - decode)

    def observe_offload(self, num_bytes: int, seconds: float) -> None:
        self.offload_bytes.inc(num_bytes)
        self.offload_s.observe(seconds)

    def observe_restore(self, num_bytes: int, seconds: float) -> None:
        self.restore_bytes.inc(num_bytes)
        self.restore_s.observe(seconds)
