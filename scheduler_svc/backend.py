"""What the public APIs (kvstash.v1.Scheduler and vllm.grpc.engine.VllmEngine)
serve with once the worker has been found: one façade over the engine, so
that both servicers, peers, ask it alone (never the engine or the core).

    requests   admit, abort, updates; reserve and decode (a decode instance)
    the model  config (its limits: max_servable_len, block_size, ...),
               tokenizer and its files, names, vocabulary, EOS ids
    the state  worker_up, stats, flush_prefix_cache, kv_events
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field

from kvstash import errors
from kvstash.common.layout import Layout
from kvstash.common.sampling import SamplingParams
from kvstash.common.tokenizer import Tokenizer
from scheduler_svc.core.config import Role, SchedulerConfig
from scheduler_svc.core.outputs import RequestUpdate, SchedulerStats
from scheduler_svc.core.request import RequestStatus
from scheduler_svc.engine import Engine
from scheduler_svc.kv_event_hub import KvEventHub
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.streams import RequestStream


@dataclass(slots=True)
class Timing:
    """One Generate call's latency, on time.monotonic()."""

    arrival: float  # when the call came in
    ttft_s: float = 0.0  # arrival to first token; 0 until one arrives


@dataclass(frozen=True, slots=True)
class Backend:
    engine: Engine
    tokenizer: Tokenizer
    metrics: SchedulerMetrics
    model: str = "kvstash"  # the model's name, as gateways list it
    # The tokenizer's files (name -> text) for gateways that tokenize.
    tokenizer_files: Mapping[str, str] = field(default_factory=dict)
    # The prefix cache's events for gateways (None: not published).
    kv_events: KvEventHub | None = None
    # What the model is, in config.json's words, for gateways: its model_type
    # ("llama") and architecture class names; empty where unknown.
    model_type: str = ""
    architectures: tuple[str, ...] = ()
    # The worker's KV layout, which a decode instance's hand-ins must have
    # (None: checked by block size and bytes only).
    kv_layout: Layout | None = None

    @property
    def role(self) -> Role:
        return self.engine.role

    @property
    def config(self) -> SchedulerConfig:
        """The model's and this instance's limits, as the core was built."""
        return self.engine.core.config

    @property
    def worker_up(self) -> bool:
        return self.engine.worker_up

    def stats(self) -> SchedulerStats:
        return self.engine.core.stats()

    def flush_prefix_cache(self) -> int:
        """Forgets every cached prefix (the KV events say so); blocks freed."""
        return self.engine.flush_prefix_cache()

    async def admit(self, request_id: str, prompt: list[int],
                    sampling: SamplingParams) -> RequestStream:
        """Engine.admit: its stream, or InvalidArgument / AlreadyExists /
        ResourceExhausted."""
        return await self.engine.admit(request_id, prompt, sampling)

    def abort(self, request_id: str,
              reported_as: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Engine.abort (NotFound for a request not live)."""
        self.engine.abort(request_id, reported_as)

    def reserve(self, request_id: str, prompt: list[int], sampling: SamplingParams) -> bool:
        """A decode instance holds blocks for a prefill instance's request;
        refused while its worker is down (the prefill instance asks another,
        or decodes the request itself)."""
        side = self.engine.decode_side
        return self.worker_up and side.reserve(request_id, prompt, sampling)

    def decode(self, request_id: str, snapshot_id: str, num_tokens: int,
               first_token_id: int) -> RequestStream:
        """A decode instance decodes a request it reserved blocks for;
        Unavailable while its worker is down (the prefill instance's relay
        asks another reservation, or takes the request back)."""
        side = self.engine.decode_side
        if not self.worker_up:
            raise errors.Unavailable("this decode instance's worker is down")
        return side.decode(request_id, snapshot_id, num_tokens, first_token_id)

    async def updates(
        self, request_id: str, stream: RequestStream, timing: Timing, *, observed: bool = True,
    ) -> AsyncGenerator[RequestUpdate, None]:
        """A submitted request's updates, the finishing one last, or the
        KvstashError that ended it. Closed before the end (the client went
        away), it aborts the request. `observed`: a client's request, whose
        end the per-request metrics count (if the core took it, as the core
        counts it); not a decode instance's part of a P/D request (Decode),
        which its prefill instance counts, from its client's arrival."""
        try:
            while True:
                event = await stream.events.get()
                if isinstance(event, errors.KvstashError):
                    raise event
                if event.new_token_ids and not timing.ttft_s:
                    timing.ttft_s = time.monotonic() - timing.arrival
                yield event
                if event.finish_status is not None:
                    return
        finally:
            if not stream.finished:  # the client went away: free everything now
                with contextlib.suppress(errors.NotFound):
                    self.abort(request_id)
            if observed and stream.admitted:
                self.metrics.observe_finished(
                    stream.finish_status, stream.usage, timing.arrival, timing.ttft_s)


class BackendSlot:
    """Where both servicers find the backend: empty until the worker has been
    found, and calls answer UNAVAILABLE until then."""

    def __init__(self) -> None:
        self._backend: Backend | None = None

    def attach(self, backend: Backend) -> None:
        self._backend = backend

    def __call__(self) -> Backend:
        if self._backend is None:
            raise errors.Unavailable("the scheduler is still waiting for its worker")
        return self._backend
