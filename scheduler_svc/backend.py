"""What the public APIs (kvstash.v1.Scheduler and vllm.grpc.engine.VllmEngine)
share once the worker has been found: admission and a request's updates."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from kvstash import errors
from kvstash.sampling import SamplingParams
from kvstash.tokenizer import Tokenizer
from scheduler_svc.core.outputs import RequestUpdate
from scheduler_svc.engine import Engine
from scheduler_svc.kv_event_hub import KvEventHub
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.streams import RequestStream


@dataclass(slots=True)
class Timing:
    """One Generate call's latency, on time.monotonic()."""

    arrival: float  # when the call came in
    ttft_s: float = 0.0  # arrival to first token; 0 until one arrives


class Backend(NamedTuple):
    """What the public calls (kvstash's and VllmEngine's) need once the worker
    has been found."""

    engine: Engine
    tokenizer: Tokenizer
    metrics: SchedulerMetrics
    role: str = "mixed"
    model: str = "kvstash"  # the model's name, as gateways list it
    # The tokenizer's files (name -> text) for gateways that tokenize.
    tokenizer_files: Mapping[str, str] = {}
    # The prefix cache's events for gateways (None: not published).
    kv_events: KvEventHub | None = None
    # What the model is, in config.json's words, for gateways: its model_type
    # ("llama") and architecture class names; empty where unknown.
    model_type: str = ""
    architectures: tuple[str, ...] = ()

    async def admit(self, request_id: str, prompt: list[int],
                    sampling: SamplingParams) -> RequestStream:
        """Submits a request (a P/D prefill instance first has a decode
        instance reserve blocks for it); raises as Engine.submit."""
        decoder = await self.engine.find_decoder(request_id, prompt, sampling)
        return self.engine.submit(request_id, prompt, sampling, decoder)

    async def updates(
        self, request_id: str, stream: RequestStream, timing: Timing,
    ) -> AsyncGenerator[RequestUpdate, None]:
        """A submitted request's updates, the finishing one last, or the
        KvstashError that ended it. Closed before the end (the client went
        away), it aborts the request."""
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
                    self.engine.abort(request_id)
            self.metrics.observe_finished(
                stream.finish_status, stream.usage, timing.arrival, timing.ttft_s)
