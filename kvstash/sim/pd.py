"""P/D pools in simulated time: prefill instances hand requests to decode
instances through the cache, as the edge does (scheduler_svc/handoff.py and
decode_peers.py), around the same core P/D calls.

    arrival     routed among the prefill instances, whose core takes it at
                once, to hand off (one output token: decoded there).
    prefilled   its first token sampled, the next schedule() hands it off:
                its KV is copied into the cache (out.handoffs), then
                finish_handoff; a refused copy decodes it on the prefill
                instance.
    committed   a decode instance reserves the request's blocks
                (PdManager.reserve, the decode instances asked in turn from a
                rotating start; one that could never hold it is skipped), and
                start_remote_decode restores the snapshot into them; its steps
                run as any. All refusing: asked again after a back-off (their
                retry hint, doubling up to 1 s) until `handoff_wait_s` is
                spent, then the prefill instance takes it back (take_back) and
                resumes it from the snapshot; so it does at once when the
                restore there fails (the decode instance gives it back).
    finished    on the decode instance: finish_remote on the prefill one.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

from kvstash.common.sampling import SamplingParams
from kvstash.errors import KvstashError
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
from scheduler_svc.core.outputs import OffloadCommand, RequestUpdate, RestoreCommand
from scheduler_svc.core.pd import (
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
        self._prefill_of: dict[str, Instance] = {}  # handed off, until it finishes there

    def _arrive(self, index: int, request: TraceRequest) -> Instance | None:
        inst = self.route(self.front, request)
        inst.routed += 1
        sampling = sampling_of(request)
        prompt = prompt_of(request, self.block_tokens, self.tokens)
        return self._admit(inst, index, prompt, sampling, handoff=sampling.max_tokens >= 2)

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

    # -- the hand-off ----------------------------------------------------------

    def _hand_off(self, inst: Instance, cmd: OffloadCommand) -> None:
        self._put(inst, cmd, self._handed_off)

    def _handed_off(self, inst: Instance, cmd: OffloadCommand, num_bytes: int | None,
                    seconds: float | None) -> Instance:
        """The copy landed: this instance wakes (a hand-off freed its blocks,
        a refused one decodes here), as the edge's engine does; a decode
        instance is sought next."""
        if inst.core.pd.finish_handoff(cmd, num_bytes, seconds):
            self.at(self.now, functools.partial(
                self._seek, inst, cmd, self.now + self.handoff_wait_s, 0.0))
        return inst

    def _seek(self, inst: Instance, cmd: OffloadCommand, deadline: float,
              backoff: float) -> Instance | None:
        """A decode instance for a handed-off request, asked again after a
        back-off until `deadline`; else it is taken back."""
        request_id = cmd.request_id
        req = inst.core.get_request(request_id)
        assert req is not None  # HANDED_OFF: nothing aborts in a simulation
        decoder = self._reserve(request_id, req.prompt_token_ids, req.sampling)
        if decoder is None:
            if self.now >= deadline:
                inst.core.pd.take_back(request_id)  # resumes here from the snapshot
                return inst
            # As decode_peers: the last round is asked at the deadline.
            backoff = min(max(RESERVATION_RETRY_AFTER_S, 2 * backoff, 0.01),
                          RESERVATION_MAX_BACKOFF_S)
            self.at(min(self.now + backoff, deadline), functools.partial(
                self._seek, inst, cmd, deadline, backoff))
            return None
        restore = decoder.core.pd.start_remote_decode(
            request_id, cmd.snapshot_id, cmd.num_tokens, req.output_token_ids[-1])
        self._prefill_of[request_id] = inst
        self._restore(decoder, restore)
        return decoder

    def _restored(self, inst: Instance, cmd: RestoreCommand, num_bytes: int | None,
                  seconds: float) -> Instance:
        """A decode instance whose restore of a hand-off failed gave it back
        (Lifecycle.finish_restore), the snapshot left: its prefill instance
        takes it back and resumes it from there at once. The edge first hands
        it off again, up to 3 times in all, and takes it back only then (the
        simulator models no restore that fails once and then succeeds)."""
        super()._restored(inst, cmd, num_bytes, seconds)
        request_id = cmd.request_id
        prefill = self._prefill_of.get(request_id)
        if prefill is None or inst.core.get_request(request_id) is not None:
            return inst
        del self._prefill_of[request_id]
        inst.held.discard(request_id)
        prefill.core.pd.take_back(request_id)
        self.at(self.now, functools.partial(_wake_up, inst))  # its blocks are free
        return prefill

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
