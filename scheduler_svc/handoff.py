"""P/D disaggregation at the edge: the two sides of a hand-off,
each built by the engine for its role only (a mixed instance has neither).

    PrefillSide  a request with more than one token to decode is submitted
                 for a hand-off (`submit`) at once. Once prefilled (its first
                 token sampled and sent), the core hands it off (`hand_off`):
                 its KV is put in the cache, then a decode instance reserves
                 blocks for it and its events are relayed into the request's
                 stream. A failed put decodes here (recomputed if its seat
                 was taken meanwhile); a decode instance lost before its
                 first token (reservation expired, gone, aborted there) is
                 released, then replaced by another reservation; one lost
                 later, one whose restore found the snapshot missing or
                 damaged (DATA_LOSS), or no reservation in time, gives the
                 request back to the core (take_back: resumed from the
                 snapshot, else recomputed): never lost.
                 `let_go` when the request will not (or no longer) decode
                 there: the relay is cancelled (which aborts it there, or
                 stops asking).

                 A decode instance knows the request by its hand-off's
                 snapshot id, not by its request id: two prefill instances
                 may each have a request of one id, but their snapshots
                 share one cache, so no two have one id.

                 Reserving only once the KV is in the cache (not when the
                 request arrives) keeps decode blocks for KV about to arrive:
                 a request never waits for decode room before its prefill,
                 and no reservation expires while its prefill queues.
    DecodeSide   reserve and decode (a restore into the reserved blocks, then
                 decoding as usual); a timer wakes the step loop when a
                 reservation may have expired. A restore that fails gives
                 the request back: its Decode call fails (DATA_LOSS where the
                 cache lacks the snapshot or holds it damaged, no use to
                 another decode instance; else UNAVAILABLE), and the
                 snapshot, its prefill instance's, stays for it to decode from.

Every call to the core's P/D API is in this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from opentelemetry import context as otel_context

from kvstash import errors
from kvstash.common.sampling import SamplingParams
from scheduler_svc import tracing
from scheduler_svc.copies import Copies
from scheduler_svc.core.outputs import OffloadCommand, RestoreCommand
from scheduler_svc.core.pd import HANDOFF_ATTEMPTS
from scheduler_svc.core.request import RequestStatus
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.decode_peers import DecodePeer, DecodePeers, RemoteAborted, RemoteFinished
from scheduler_svc.inflight import Handoff, InFlight, InFlightRequests, Tasks
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.streams import RequestStream

log = logging.getLogger(__name__)



class PrefillSide:
    def __init__(
        self, core: Scheduler, peers: DecodePeers, copies: Copies, requests: InFlightRequests,
        tasks: Tasks, wake: Callable[[], None], metrics: SchedulerMetrics | None,
    ) -> None:
        self._core = core
        self._peers = peers
        self._copies = copies
        self._requests = requests
        self._tasks = tasks
        self._wake = wake
        self._metrics = metrics

    @staticmethod
    def hands_off(sampling: SamplingParams) -> bool:
        """More than its first token to decode: worth a decode instance."""
        return sampling.max_tokens >= 2

    def submit(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
        stored_segments: int | None = 0, block_hashes: Sequence[int] = (),
    ) -> RequestStream:
        """Admits a request to be handed off once prefilled (raises as
        Engine.submit)."""
        self._core.add_request(request_id, prompt_token_ids, sampling, handoff=True,
                               stored_segments=stored_segments, block_hashes=block_hashes)
        return self._requests.open(request_id, Handoff())

    def let_go(self, handoff: Handoff) -> None:
        """The request will not (or no longer) decode on a decode instance."""
        if handoff.relay is not None:
            handoff.relay.cancel()

    def _decode_here(self, record: InFlight) -> None:
        if (handoff := record.handoff) is not None:
            record.handoff = None
            self.let_go(handoff)

    async def hand_off(self, cmd: OffloadCommand) -> None:
        """Puts a prefilled request's KV in the cache for its decode instance,
        then relays that instance's tokens. The core hears of the copy
        whatever happens, as for an offload."""
        started = time.monotonic()
        request_id = cmd.request_id
        record = self._requests.get(request_id)
        handed_off = await self._copies.put(cmd, "handoff", self._core.pd.finish_handoff)
        # Aborted meanwhile (its id maybe reused already), or failed with its worker.
        if record is None or record.handoff is None or self._requests.get(request_id) is not record:
            return
        if not handed_off:  # the copy failed
            self._decode_here(record)
            return
        req = self._core.get_request(request_id)
        assert req is not None
        first_token_id = req.output_token_ids[-1]
        handoff_id = cmd.snapshot_id  # its name on the decode instance
        handoff = record.handoff
        handoff.relay = asyncio.current_task()
        # The Decode call joins the request's trace.
        trace_context = self._requests.trace_context(request_id)
        token = None if trace_context is None else otel_context.attach(trace_context)
        try:
            for attempt in range(1, HANDOFF_ATTEMPTS + 1):
                decoder = await self._peers.reserve(handoff_id, req.prompt_token_ids,
                                                    req.sampling)
                if decoder is None:
                    log.warning("request %s: no decode instance reserved blocks in time",
                                request_id)
                    break
                reason = await self._relay(decoder, cmd, first_token_id, started)
                if reason is None:
                    return  # finished there, or taken back after its tokens began
                # Its reservation expired, or the instance went away: the
                # snapshot is still in the cache for another reservation.
                log.warning("request %s: decode instance %s lost before its first token (%s)%s",
                            request_id, decoder.address, reason,
                            "; trying again" if attempt < HANDOFF_ATTEMPTS else "")
                # Its blocks go back before the next reservation, which this
                # release (an Abort by its id there) would end if it came later;
                # shielded, so an abort meanwhile leaves it to be sent.
                await asyncio.shield(self._peers.release_later(decoder, handoff_id))
            log.warning("request %s: finishing it here", request_id)
            self._take_back(request_id)
        except errors.DataLoss as exc:
            log.warning("request %s: %s; finishing it here", request_id, exc)
            self._take_back(request_id)
        except errors.IntegrityError:
            raise
        except Exception:  # a bug, or a peer's surprise: its client is still served here
            log.exception("request %s: its hand-off failed; finishing it here", request_id)
            self._take_back(request_id)
        finally:
            if token is not None:
                otel_context.detach(token)
            if (record := self._requests.get(request_id)) is not None and (
                    record.handoff is handoff):
                record.handoff = None  # decoding here now

    async def _relay(
        self, decoder: DecodePeer, cmd: OffloadCommand, first_token_id: int, started: float
    ) -> str | None:
        """The decode instance's tokens into the request's stream. None once
        the request finished there, or was lost there after some tokens (the
        core took it back: it is recomputed here); else why it was lost
        before sending any."""
        request_id = cmd.request_id
        core = self._core
        first = True
        try:
            async with contextlib.aclosing(self._peers.decode(
                    decoder, cmd.snapshot_id, cmd.snapshot_id, cmd.num_tokens,
                    first_token_id)) as events:
                async for event in events:
                    if isinstance(event, RemoteAborted):
                        reason = "aborted there"
                        break
                    # Timed to the decode instance's first token.
                    if first and self._metrics is not None:
                        self._metrics.handoff_s.observe(time.monotonic() - started)
                    first = False
                    if isinstance(event, RemoteFinished):
                        update = core.pd.finish_remote(
                            request_id, event.token_ids,
                            event.status is RequestStatus.FINISHED_STOPPED, event.usage)
                        record = self._requests.close(request_id)
                        if update is not None and record is not None:
                            record.stream.push(update)
                        return None
                    update = core.pd.remote_tokens(request_id, event.token_ids)
                    if update is not None and (stream := self._requests.stream(
                            request_id)) is not None:
                        stream.push(update)
                else:
                    reason = "its stream ended early"
        except errors.KvstashError as exc:  # the call failed, or impossible tokens
            if first and isinstance(exc, errors.DataLoss):
                raise  # its snapshot is gone or damaged: no decode instance can restore it
            reason = str(exc)
        if first:
            return reason
        log.warning("request %s: decode instance %s lost (%s); finishing it here",
                    request_id, decoder.address, reason)
        self._take_back(request_id)
        return None

    def _take_back(self, request_id: str) -> None:
        req = self._core.get_request(request_id)
        if req is not None and req.status is RequestStatus.HANDED_OFF:
            self._core.pd.take_back(request_id)
            # Nothing came back yet: it resumes from its snapshot (OFFLOADED).
            tracing.request_event(self._requests.trace_context(request_id), "taken_back", {
                "kvstash.outcome": "resume_from_snapshot"
                if req.status is RequestStatus.OFFLOADED else "recompute"})
        self._wake()


class DecodeSide:
    def __init__(self, core: Scheduler, copies: Copies, requests: InFlightRequests,
                 tasks: Tasks, wake: Callable[[], None]) -> None:
        self._core = core
        self._copies = copies
        self._requests = requests
        self._tasks = tasks
        self._wake = wake

    def reserve(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> bool:
        """Holds blocks for a prefill instance's request (PdManager.reserve);
        False: refused, ask again later."""
        if not self._core.pd.reserve(request_id, prompt_token_ids, sampling):
            return False
        # The step loop expires it if unused: wake it then.
        asyncio.get_running_loop().call_later(self._core.config.reservation_timeout_s,
                                              self._wake)
        return True

    def decode(
        self, request_id: str, snapshot_id: str, num_tokens: int, first_token_id: int
    ) -> RequestStream:
        """Restores a reserved request's prompt KV and decodes it: its stream
        (raises NotFound / InvalidArgument as PdManager.start_remote_decode)."""
        cmd = self._core.pd.start_remote_decode(request_id, snapshot_id, num_tokens,
                                                first_token_id)
        stream = self._requests.open(request_id, prefilled=True)
        self._tasks.spawn(self._restore(cmd))
        self._wake()
        return stream

    async def _restore(self, cmd: RestoreCommand) -> None:
        outcome = await self._copies.restore(cmd, fallback="given_back")
        # Given back by the core (Lifecycle.finish_restore) if its record
        # outlived it: an abort or a lost worker closes the record first.
        if self._core.get_request(cmd.request_id) is None and (
                record := self._requests.close(cmd.request_id)) is not None:
            why = (f"request {cmd.request_id}: its snapshot {cmd.snapshot_id} could not be "
                   f"restored here ({outcome.error}); given back to its prefill instance")
            # DATA_LOSS (not NOT_FOUND, which says the reservation is gone): a
            # snapshot the cache lacks or holds damaged is so for every decode
            # instance, so its prefill instance offers it to no other.
            record.stream.fail(errors.DataLoss(why) if outcome.missing or outcome.damaged
                               else errors.Unavailable(why), None)
