"""P/D disaggregation: what a scheduler in a P/D role adds to the core.

A scheduler whose config names role PREFILL or DECODE composes one
`PdManager` (`Scheduler.pd`); a MIXED one has none, and its steps never
enter this module. The step only calls its hooks: `on_schedule` (before
preemption), `on_prefilled` and `on_finish` (from update()) and `on_abort`.

    prefill instance  a request added with handoff=True is, once its first
                      token is sampled, handed off at the next schedule():
                      its blocks are copied out (`out.handoffs`), then it is
                      HANDED_OFF while a decode instance decodes it
                      (`remote_tokens`, `finish_remote`; `take_back` if lost)
    decode instance   `reserve()` holds a prompt's blocks under admission's
                      rule (never by preempting); `start_remote_decode()`
                      restores the prefill instance's snapshot into them;
                      unused reservations expire at schedule()

The paths the P/D statuses add (Lifecycle.move checks them against its table):

    prefill instance:  RUNNING_DECODE ──handoff──▶ HANDING_OFF ──committed──▶ HANDED_OFF
                       (its first token sampled)      │ copy failed             │ decoded there
                            ▲                         ▼                         ▼
                            └──────────────── RUNNING_DECODE          FINISHED_STOPPED/LENGTH
                                              (WAITING to recompute if
                                              its seat, freed at the
                                              handoff, was taken)
                       HANDED_OFF ──decode instance lost──▶ OFFLOADED (no token came back),
                                                            WAITING (recompute) otherwise
    decode instance:   RESERVED ──its snapshot arrives──▶ RESUMING ──▶ RUNNING_DECODE ...
                       RESERVED ──unused until reserved_until──▶ FINISHED_ABORTED
                       RESUMING ──restore failed: given back, its snapshot
                                  left to the prefill instance──▶ FINISHED_ABORTED

Which requests go to a decode instance is kept here, not on the request:
`awaiting_prefill` (WAITING or RUNNING_PREFILL), then `to_hand_off`
(RUNNING_DECODE, its first token sampled) until the next schedule() starts
its copy. A request leaves both when it is handed off, finishes or is
aborted (invariants.py checks it). Every status and snapshot change goes
through `Lifecycle`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstash.common.sampling import SamplingParams
from kvstash.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from scheduler_svc.core.admission import Admission
from scheduler_svc.core.config import Role, SchedulerConfig
from scheduler_svc.core.costs import CostModel
from scheduler_svc.core.intake import Intake
from scheduler_svc.core.lifecycle import (
    FINISHED_LENGTH,
    FINISHED_STOPPED,
    HANDED_OFF,
    HANDING_OFF,
    RESERVED,
    Lifecycle,
)
from scheduler_svc.core.outputs import (
    OffloadCommand,
    RequestUpdate,
    RestoreCommand,
    SchedulerOutput,
)
from scheduler_svc.core.request import Request, RequestUsage

# The hand-off protocol's timings: one source for the edge (server.py,
# decode_peers.py, handoff.py) and for kvstash sim.
RESERVATION_RETRY_AFTER_S = 0.05  # a refusal's hint: a decode step or two frees blocks
RESERVATION_MAX_BACKOFF_S = 1.0  # the longest wait between rounds of refusals
HANDOFF_WAIT_S = 10.0  # refusals a prefill instance sits out before decoding it itself
HANDOFF_ATTEMPTS = 3  # decode instances a committed hand-off is offered to in turn


class PdManager:
    def __init__(
        self, config: SchedulerConfig, life: Lifecycle, intake: Intake, admission: Admission,
        costs: CostModel, clock: Callable[[], float],
    ) -> None:
        if config.role is Role.MIXED:
            raise ValueError("a MIXED scheduler has no P/D manager")
        self.config = config
        self.role = config.role
        self.life = life
        self._intake = intake
        self._admission = admission
        self._costs = costs  # handoff copies teach it as offloads do
        self._clock = clock
        # Prefill instance: requests that go to a decode instance once
        # prefilled, then those prefilled, handed off at the next schedule().
        self.awaiting_prefill: dict[str, Request] = {}
        self.to_hand_off: dict[str, Request] = {}

    def require(self, role: Role, what: str) -> None:
        """FailedPrecondition unless this scheduler runs in `role`."""
        if self.role is not role:
            raise FailedPrecondition(f"this scheduler runs in role {self.role.value}; only a "
                                     f"{role.value} instance {what}")

    # ------------------------------------------------------------- hooks

    def on_schedule(self, out: SchedulerOutput) -> None:
        """schedule(), before preemption: unused reservations end; prefilled
        requests are handed off (their copies in `out.handoffs`)."""
        life = self.life
        if life.reserved:
            now = self._clock()
            for req in [r for r in life.reserved.values() if r.reserved_until <= now]:
                life.counters.num_reservations_expired += 1
                life.abort(req.request_id)
        if self.to_hand_off:
            out.handoffs = [life.start_offload(r, HANDING_OFF) for r in self.to_hand_off.values()]
            self.to_hand_off = {}

    def on_prefilled(self, reqs: Sequence[Request]) -> None:
        """update() sampled the first token of `reqs` (now RUNNING_DECODE)."""
        awaiting = self.awaiting_prefill
        if awaiting:
            for req in reqs:
                if awaiting.pop(req.request_id, None) is not None:
                    self.to_hand_off[req.request_id] = req

    def on_finish(self, req: Request) -> None:
        """update() finished req (its first token may have ended it)."""
        self.to_hand_off.pop(req.request_id, None)

    def on_abort(self, req: Request) -> None:
        request_id = req.request_id
        self.awaiting_prefill.pop(request_id, None)
        self.to_hand_off.pop(request_id, None)

    # --------------------------------------------------- prefill instance

    def hand_off_once_prefilled(self, req: Request) -> None:
        """Scheduler.add_request(handoff=True): a decode instance reserved
        blocks for req (WAITING); once prefilled it goes there."""
        self.awaiting_prefill[req.request_id] = req

    def will_hand_off(self, request_id: str) -> bool:
        """The request is to go to a decode instance and has not yet."""
        return request_id in self.awaiting_prefill or request_id in self.to_hand_off

    def finish_handoff(
        self, cmd: OffloadCommand, num_bytes: int | None, seconds: float | None = None
    ) -> bool:
        """Prefill instance: the handoff copy landed. True: the request is
        HANDED_OFF (ask the decode instance to decode it); False: it decodes
        here (the copy failed) or was aborted."""
        self.require(Role.PREFILL, "hands requests off")
        req = self.life.finish_handoff(cmd, num_bytes)
        if num_bytes is not None and seconds is not None:
            self._costs.observe_offload(len(cmd.block_ids), seconds)
        return req.status is HANDED_OFF

    def remote_tokens(self, request_id: str, token_ids: Sequence[int]) -> RequestUpdate | None:
        """Prefill instance: tokens the decode instance generated; None if the
        request is no longer HANDED_OFF (aborted). InvalidArgument for tokens
        it could not have generated (_check_remote_tokens)."""
        req = self._handed_off(request_id)
        if req is None:
            return None
        self._check_remote_tokens(req, token_ids, final=False)
        return self._add_remote_tokens(req, token_ids)

    def finish_remote(
        self, request_id: str, token_ids: Sequence[int], stopped: bool, remote: RequestUsage
    ) -> RequestUpdate | None:
        """Prefill instance: the decode instance finished the request with
        token_ids (stop token or length, `stopped` says which); its
        preemptions there count in the usage. InvalidArgument (nothing
        recorded) for an end that does not match the tokens."""
        req = self._handed_off(request_id)
        if req is None:
            return None
        self._check_remote_tokens(req, token_ids, final=True)
        output = [*req.output_token_ids, *token_ids]
        at_length = len(output) >= req.sampling.max_tokens  # a length end (Scheduler._finish)
        if stopped == at_length or (stopped and output[-1] not in req.stop_ids):
            raise InvalidArgument(
                f"request {request_id}: a remote {'stop' if stopped else 'length'} finish "
                f"after {len(output)} tokens ending in {output[-1]} (max_tokens "
                f"{req.sampling.max_tokens})")
        update = self._add_remote_tokens(req, token_ids)
        req.num_preemptions += remote.num_preemptions
        req.num_recomputed_tokens += remote.num_recomputed_tokens
        req.bytes_offloaded += remote.bytes_offloaded
        self.life.finish_remote(req, FINISHED_STOPPED if stopped else FINISHED_LENGTH)
        update.finish_status = req.status
        update.usage = req.usage()
        return update

    def _check_remote_tokens(self, req: Request, token_ids: Sequence[int], final: bool) -> None:
        """What a decode instance sends must be possible: InvalidArgument (and
        nothing recorded) for tokens outside the vocabulary, or for a token
        that ends the request (a stop token, max_tokens reached) anywhere but
        last in the finish (`final`), which carries it."""
        vocab_size = self.config.vocab_size
        # Tokens that must not end the request: all but a finish's last.
        num_going_on = len(token_ids) - 1 if final else len(token_ids)
        for i, token_id in enumerate(token_ids):
            if not 0 <= token_id < vocab_size:
                raise InvalidArgument(f"request {req.request_id}: remote token {token_id} is "
                                      f"outside the vocabulary [0, {vocab_size})")
            if i < num_going_on and token_id in req.stop_ids:
                raise InvalidArgument(f"request {req.request_id}: remote stop token {token_id} "
                                      f"is not the last of a finish")
        num_output = len(req.output_token_ids) + num_going_on
        if num_output >= req.sampling.max_tokens:
            raise InvalidArgument(f"request {req.request_id}: remote tokens reach max_tokens "
                                  f"{req.sampling.max_tokens} before the finish")

    @staticmethod
    def _add_remote_tokens(req: Request, token_ids: Sequence[int]) -> RequestUpdate:
        req.output_token_ids.extend(token_ids)  # counted where they were sampled
        return RequestUpdate(req.request_id, list(token_ids),
                             num_cached_tokens=req.num_cached_tokens)

    def take_back(self, request_id: str) -> None:
        """Prefill instance: the decode instance was lost; the request finishes
        here (Lifecycle.take_back). Nothing if it is no longer HANDED_OFF."""
        if (req := self._handed_off(request_id)) is not None:
            self.life.take_back(req)

    def _handed_off(self, request_id: str) -> Request | None:
        self.require(Role.PREFILL, "hands requests off")
        req = self.life.requests.get(request_id)
        return req if req is not None and req.status is HANDED_OFF else None

    # ---------------------------------------------------- decode instance

    def reserve(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> bool:
        """Decode instance: holds the blocks a prefill instance's request needs
        (raises as add_request does). Accepted only if admission's reservations
        (the request's own included) still fit after it, a seat is free and no
        preempted request waits; False otherwise: nothing changed, ask again later."""
        self.require(Role.DECODE, "reserves blocks for a prefill instance")
        self._intake.check(request_id, prompt_token_ids, sampling)
        if sampling.max_tokens < 2:
            raise InvalidArgument(f"request {request_id}: max_tokens {sampling.max_tokens} "
                                  "leaves nothing to decode after prefill")
        req = self._intake.create(request_id, prompt_token_ids, sampling, RESERVED)
        req.remote = True
        life = self.life
        counters = life.counters
        # As admission: nothing new while a preempted request waits to come back.
        if (life.num_running >= self.config.max_num_seqs or life.waiting or life.offloaded
                or life.offloading):
            counters.num_reservations_refused += 1
            return False
        # Its own growth beyond the prompt's blocks, which life.reserve allocates.
        growth = self._admission.reservation.reserved_blocks(
            req, num_held=life.kv.num_blocks_for(req.num_prompt_tokens))
        kept_back = self._admission.blocks_kept_back() + growth
        if not life.reserve(req, kept_back, self._clock() + self.config.reservation_timeout_s):
            counters.num_reservations_refused += 1
            return False
        counters.num_reservations_accepted += 1
        return True

    def start_remote_decode(
        self, request_id: str, snapshot_id: str, num_tokens: int, first_token_id: int
    ) -> RestoreCommand:
        """Decode instance: the KV of a RESERVED request's prompt is in
        snapshot_id and its first token was sampled; the copy into its blocks
        starts (answered with Scheduler.finish_restore), then it decodes here."""
        self.require(Role.DECODE, "decodes for a prefill instance")
        req = self.life.requests.get(request_id)
        if req is None or req.status is not RESERVED:
            raise NotFound(f"request {request_id} holds no reservation (never made, "
                           "expired, or already used)")
        if num_tokens != req.num_prompt_tokens:
            raise InvalidArgument(f"request {request_id}: the snapshot holds {num_tokens} "
                                  f"tokens, its prompt has {req.num_prompt_tokens}")
        if snapshot_id in self.life.copies:
            raise AlreadyExists(f"request {request_id}: snapshot {snapshot_id} is already "
                                "being copied here")
        if not 0 <= first_token_id < self.config.vocab_size or first_token_id in req.stop_ids:
            raise InvalidArgument(f"request {request_id}: first token {first_token_id} is "
                                  "outside the vocabulary or ends the request")
        # Its prompt counted where it was prefilled: a prefill here is a recompute.
        req.first_token_time = self._clock()
        return self.life.start_remote_decode(req, snapshot_id, first_token_id)
