"""P/D pools in simulated time: prefill instances hand requests to decode
instances through the cache, as the edge does (scheduler_svc/handoff.py and
decode_peers.py), around the same core P/D calls.

    arrival     routed among the prefill instances; a decode instance
                reserves the request's blocks first (PdManager.reserve, the
                decode instances asked in turn from a rotating start; one
                that could never hold it is skipped). All refusing: asked
                again after a back-off (their retry hint, doubling up to 1
                s) until `handoff_wait_s` is spent, then the prefill instance
                decodes it itself. One output token: no reservation. The
                request reaches the prefill core only then.
    prefilled   its first token sampled, the next schedule() hands it off:
                its KV is copied into the cache (out.handoffs), then
                finish_handoff; a refused copy decodes it on the prefill
                instance and lets the reservation go.
    committed   start_remote_decode on the decode instance, whose restore
                and steps run as any; a reservation that expired meanwhile
                is replaced by another (3 tries, as the edge), else the
                prefill instance takes it back (take_back) and resumes it
                from the snapshot.
    finished    on the decode instance: finish_remote on the prefill one.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

from kvstash.common.sampling import SamplingParams
from kvstash.errors import KvstashError, NotFound
from kvstash.sim.cache import SimCache
from kvstash.sim.cluster import (
    TOKEN,
    Cluster,
    Instance,
    instance_configs,
    prompt_of,
    sampling_of,
)
from kvstash.sim.profile import CostProfile
from kvstash.workload.trace import TraceRequest
from scheduler_svc.core.config import Role, SchedulerConfig
from scheduler_svc.core.outputs import OffloadCommand, RequestUpdate
from scheduler_svc.core.pd import (
    HANDOFF_ATTEMPTS,
    HANDOFF_WAIT_S,
    RESERVATION_MAX_BACKOFF_S,
    RESERVATION_RETRY_AFTER_S,
)


def pd_configs(policy: str, prefill: int, decode: int, **settings: Any
               ) -> tuple[list[SchedulerConfig], list[SchedulerConfig]]:
    """The two pools' configs under a named policy; snapshot ids kept apart."""
    return (instance_configs(policy, prefill, role=Role.PREFILL, prefix="p", **settings),
            instance_configs(policy, decode, role=Role.DECODE, prefix="d", **settings))


class PdCluster(Cluster):
    def __init__(self, prefill: Sequence[SchedulerConfig], decode: Sequence[SchedulerConfig],
                 profile: CostProfile, cache: SimCache, transport: str = "arena",
                 router: str = "round-robin", handoff_wait_s: float = HANDOFF_WAIT_S) -> None:
        if not prefill or not decode:
            raise ValueError("P/D needs at least one prefill and one decode instance")
        super().__init__([*prefill, *decode], profile, cache, transport, router)
        self.front = self.instances[:len(prefill)]
        self.decoders = self.instances[len(prefill):]
        self.handoff_wait_s = handoff_wait_s
        self._turn = itertools.count()
        self._decoder_of: dict[str, Instance] = {}  # reserved for, until its decode starts
        self._prefill_of: dict[str, Instance] = {}  # handed off, until it finishes there

    # -- arrival: a reservation first ------------------------------------------

    def _arrive(self, index: int, request: TraceRequest) -> Instance | None:
        inst = self.route(self.front, request)
        inst.routed += 1
        return self._seek(inst, index, prompt_of(request, self.block_tokens),
                          sampling_of(request), self.now + self.handoff_wait_s, 0.0)

    def _seek(self, inst: Instance, index: int, prompt: list[int], sampling: SamplingParams,
              deadline: float, backoff: float) -> Instance | None:
        request_id = str(index)
        if sampling.max_tokens < 2:
            return self._admit(inst, index, prompt, sampling)
        try:
            inst.core.check_request(request_id, prompt, sampling)
        except KvstashError as exc:  # as add_request would refuse it
            self._refused(index, exc)
            return None
        decoder = self._reserve(request_id, prompt, sampling)
        if decoder is None:
            backoff = min(max(RESERVATION_RETRY_AFTER_S, 2 * backoff, 0.01),
                          RESERVATION_MAX_BACKOFF_S)
            if self.now + backoff <= deadline:
                self.at(self.now + backoff, functools.partial(
                    self._seek, inst, index, prompt, sampling, deadline, backoff))
                return None
            return self._admit(inst, index, prompt, sampling)  # decoded there
        self._decoder_of[request_id] = decoder
        if self._admit(inst, index, prompt, sampling, handoff=True) is None:
            self._release(decoder, request_id)
            return None
        return inst

    def _reserve(self, request_id: str, prompt: Sequence[int], sampling: SamplingParams
                 ) -> Instance | None:
        """One round over the decode instances from a rotating start: the one
        that reserved, or None."""
        start = next(self._turn)
        for i in range(len(self.decoders)):
            decoder = self.decoders[(start + i) % len(self.decoders)]
            try:
                reserved = decoder.core.pd.reserve(request_id, prompt, sampling)
            except KvstashError:  # one it can never hold: skipped, as the edge does
                continue
            if reserved:
                decoder.held.add(request_id)
                # Its expiry wakes it, as the edge's timer does.
                self.at(self.now + decoder.core.config.reservation_timeout_s,
                        functools.partial(_wake_up, decoder))
                return decoder
        return None

    def _release(self, decoder: Instance, request_id: str) -> None:
        """Lets a reservation go (an abort there); its decode instance wakes."""
        decoder.core.abort(request_id)
        decoder.held.discard(request_id)
        self.at(self.now, functools.partial(_wake_up, decoder))

    # -- the hand-off ----------------------------------------------------------

    def _hand_off(self, inst: Instance, cmd: OffloadCommand) -> None:
        self._put(inst, cmd, self._handed_off)

    def _handed_off(self, inst: Instance, cmd: OffloadCommand, num_bytes: int | None,
                    seconds: float | None) -> Instance:
        request_id = cmd.request_id
        decoder = self._decoder_of.pop(request_id)
        if not inst.core.pd.finish_handoff(cmd, num_bytes, seconds):  # decodes here
            self._release(decoder, request_id)
            return inst
        req = inst.core.get_request(request_id)
        assert req is not None  # HANDED_OFF
        first_token_id = req.output_token_ids[-1]
        for attempt in range(HANDOFF_ATTEMPTS):
            try:
                restore = decoder.core.pd.start_remote_decode(
                    request_id, cmd.snapshot_id, cmd.num_tokens, first_token_id)
            except NotFound:  # its reservation expired: another, while any reserves
                decoder.held.discard(request_id)
                found = None
                if attempt < HANDOFF_ATTEMPTS - 1:
                    found = self._reserve(request_id, req.prompt_token_ids, req.sampling)
                if found is None:
                    break
                decoder = found
                continue
            self._prefill_of[request_id] = inst
            self._restore(decoder, restore)
            # The hand-off freed its blocks here: this instance wakes too, as
            # the edge's landed copy wakes its engine.
            self.at(self.now, functools.partial(_wake_up, inst))
            return decoder
        inst.core.pd.take_back(request_id)  # resumes here from the snapshot
        return inst

    def _finished(self, inst: Instance, update: RequestUpdate) -> None:
        prefill = self._prefill_of.pop(update.request_id, None)
        if prefill is None:  # finished where it was prefilled
            return
        record = self.records[int(update.request_id)]
        assert update.usage is not None  # a finishing update carries it
        prefill.core.pd.finish_remote(update.request_id, [TOKEN] * (record.num_tokens - 1),
                                      False, update.usage)
        prefill.held.discard(update.request_id)


def _wake_up(inst: Instance) -> Instance:
    """An event that only wakes `inst`."""
    return inst
