"""Lifecycle: the one owner of every request's status, queue, blocks and snapshot.

    WAITING ──admit──▶ RUNNING_PREFILL ──last chunk──▶ RUNNING_DECODE ──stop/length──▶ FINISHED
       ▲                                                 │     ▲
       │◀────────── recompute (KV dropped) ──────────────┤     │ restored
       │                                                 │     │
       │◀── copy failed ── OFFLOADING ◀──── offload ─────┘   RESUMING
       │                       │ committed                     ▲  │
       │                       ▼                               │  │
       │                   OFFLOADED ──────── resume ──────────┘  │
       │◀──────────────────────────────────── restore failed ─────┘

P/D disaggregation (pd.py pictures its paths) adds RESERVED on a decode
instance and HANDING_OFF, HANDED_OFF on a prefill instance; the prefix tier
(prefix_tier.py) adds WAITING ──admit──▶ LOADING ──loaded──▶ RUNNING_PREFILL.
_NEXT holds them all.

    any live status ──abort──▶ FINISHED_ABORTED

`move(req, to)` is the only writer of a request's status: it checks the
transition against the picture and keeps the request in the one queue its
status names. What a status may hold:

    status           queue        blocks                           snapshot
    WAITING          waiting      none                             none
    RUNNING_PREFILL  prefilling   all of prompt + output           none
    RUNNING_DECODE   decoding     cover num_computed (+1)          none
    OFFLOADING       offloading   pinned by its copy               being written
    OFFLOADED        offloaded    none                             yes
    RESUMING         resuming     pinned by its copy               being read
    LOADING          loading      all of prompt + output, pinned   none (segments being read)
                                  by its load
    RESERVED         reserved     the prompt's, empty              none
    HANDING_OFF      handing_off  pinned by its copy               being written
    HANDED_OFF       handed_off   none                             yes (read there)

A copy in flight is keyed by its snapshot id (a load by its load id) and owns
the blocks it pins: an aborted request leaves every queue at once (its id can
be reused), and its copy frees the blocks when it lands. invariants.py checks
the table.

Why one file over 300 lines: the transition table, the queues and every
move that frees blocks or writes a snapshot are one rule (one writer, checked
against one table), read together to see that it holds; a move kept
elsewhere would be a second writer.
The prefix tier's LOADING moves live here for the same reason: they are
status writes that hand blocks between a load and its request.
"""

from __future__ import annotations

import bisect
from collections import deque

from kvstash.common.ids import snapshot_id_for
from kvstash.errors import FailedPrecondition, IntegrityError, NotFound
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.kv_manager import KVCacheManager
from scheduler_svc.core.outputs import Counters, OffloadCommand, RestoreCommand
from scheduler_svc.core.request import Request, RequestStatus, Snapshot

WAITING = RequestStatus.WAITING
RUNNING_PREFILL = RequestStatus.RUNNING_PREFILL
RUNNING_DECODE = RequestStatus.RUNNING_DECODE
OFFLOADING = RequestStatus.OFFLOADING
OFFLOADED = RequestStatus.OFFLOADED
RESUMING = RequestStatus.RESUMING
LOADING = RequestStatus.LOADING
RESERVED = RequestStatus.RESERVED
HANDING_OFF = RequestStatus.HANDING_OFF
HANDED_OFF = RequestStatus.HANDED_OFF
FINISHED_STOPPED = RequestStatus.FINISHED_STOPPED
FINISHED_LENGTH = RequestStatus.FINISHED_LENGTH
FINISHED_ABORTED = RequestStatus.FINISHED_ABORTED

_DONE = {FINISHED_STOPPED, FINISHED_LENGTH, FINISHED_ABORTED}
# The picture above, as data.
_NEXT: dict[RequestStatus, frozenset[RequestStatus]] = {
    WAITING: frozenset({RUNNING_PREFILL, LOADING, FINISHED_ABORTED}),
    LOADING: frozenset({RUNNING_PREFILL, FINISHED_ABORTED}),
    RUNNING_PREFILL: frozenset({RUNNING_DECODE, FINISHED_ABORTED}),
    RUNNING_DECODE: frozenset({WAITING, OFFLOADING, HANDING_OFF, *_DONE}),
    OFFLOADING: frozenset({WAITING, OFFLOADED, FINISHED_ABORTED}),
    OFFLOADED: frozenset({RESUMING, FINISHED_ABORTED}),
    RESUMING: frozenset({WAITING, RUNNING_DECODE, FINISHED_ABORTED}),
    RESERVED: frozenset({RESUMING, FINISHED_ABORTED}),
    HANDING_OFF: frozenset({HANDED_OFF, RUNNING_DECODE, WAITING, FINISHED_ABORTED}),
    HANDED_OFF: frozenset({OFFLOADED, WAITING, *_DONE}),
}


class Lifecycle:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, counters: Counters) -> None:
        self.config = config
        self.kv = kv
        self.counters = counters  # finishes and copies are counted here
        # Every live request, by id.
        self.requests: dict[str, Request] = {}
        # Queues by status; dicts keep arrival order and remove in O(1).
        self.waiting: deque[Request] = deque()
        self.prefilling: dict[str, Request] = {}
        self.decoding: dict[str, Request] = {}
        self.offloading: dict[str, Request] = {}
        self.offloaded: list[Request] = []  # by arrival: older ones resume first
        self.resuming: dict[str, Request] = {}
        self.loading: dict[str, Request] = {}
        self.reserved: dict[str, Request] = {}
        self.handing_off: dict[str, Request] = {}
        self.handed_off: dict[str, Request] = {}
        # Copies in flight by snapshot id, with the request whose blocks they pin
        # (aborted requests included).
        self.copies: dict[str, Request] = {}
        # Prefix-tier loads in flight by load id, likewise.
        self.loads: dict[str, Request] = {}
        self._snapshots_to_delete: list[str] = []
        self._num_snapshots = 0
        self._queues: dict[RequestStatus, dict[str, Request]] = {
            RUNNING_PREFILL: self.prefilling, RUNNING_DECODE: self.decoding,
            OFFLOADING: self.offloading, RESUMING: self.resuming, LOADING: self.loading,
            RESERVED: self.reserved,
            HANDING_OFF: self.handing_off, HANDED_OFF: self.handed_off,
        }

    # ------------------------------------------------------------- moves

    def add(self, req: Request) -> None:
        """A new request: WAITING, behind everything queued."""
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def reserve(self, req: Request, num_reserved_blocks: int, until: float) -> bool:
        """P/D, decode instance: a new RESERVED request holding the blocks its
        prompt's KV will arrive in, while `num_reserved_blocks` more stay
        allocatable afterwards, until `until`. False (nothing changed) if they
        are not."""
        if req.status is not RESERVED:
            raise IntegrityError(f"request {req.request_id} is {req.status.value}, not reserved")
        if self.kv.allocate_slots(req, req.num_prompt_tokens, (), num_reserved_blocks) is None:
            return False
        req.reserved_until = until
        self.requests[req.request_id] = req
        self.reserved[req.request_id] = req
        return True

    def move(self, req: Request, to: RequestStatus, *, counted: bool = True) -> None:
        """The only status writer: leaves the old queue, joins the new one. A
        request that ends counts in num_finished unless not `counted`."""
        status = req.status
        if to not in _NEXT.get(status, ()):
            raise IntegrityError(
                f"request {req.request_id}: {status.value} -> {to.value} is no transition")
        rid = req.request_id
        if status is WAITING:
            if self.waiting[0] is req:
                self.waiting.popleft()
            else:
                self.waiting.remove(req)
        elif status is OFFLOADED:
            self.offloaded.remove(req)
        else:
            del self._queues[status][rid]
        req.status = to
        if to is WAITING:
            self._requeue(req)
        elif to is OFFLOADED:
            keys = [r.arrival_seq for r in self.offloaded]
            self.offloaded.insert(bisect.bisect(keys, req.arrival_seq), req)
        elif to in _DONE:
            del self.requests[rid]
            if counted:
                self.counters.num_finished += 1
        else:
            self._queues[to][rid] = req

    def _requeue(self, req: Request) -> None:
        """Back to WAITING to be recomputed: ahead of every new arrival, behind
        preempted requests that arrived before it (they keep their places)."""
        waiting = self.waiting
        i = 0
        while (i < len(waiting) and waiting[i].output_token_ids
               and waiting[i].arrival_seq < req.arrival_seq):
            i += 1
        waiting.insert(i, req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """A running request is done (stop token or max_tokens): its blocks go back."""
        self.kv.free(req)
        self.move(req, status)

    def abort(self, request_id: str) -> Request:
        """Ends a live request in any status. A copy in flight keeps pinning its
        blocks (it frees them when it lands); a stashed snapshot is deleted."""
        req = self.requests.get(request_id)
        if req is None:
            raise NotFound(f"request {request_id} is unknown or already finished")
        status = req.status
        if status in (RUNNING_PREFILL, RUNNING_DECODE, RESERVED):
            self.kv.free(req)
        elif status is OFFLOADED or status is HANDED_OFF:
            self._drop_snapshot(req)
        self.move(req, FINISHED_ABORTED, counted=not req.remote)
        return req

    def recompute(self, req: Request) -> None:
        """Drops req's KV (and snapshot): WAITING, its output kept, to be prefilled again."""
        if req.block_ids:
            self.kv.free(req)
        req.recompute_until = max(req.recompute_until, req.num_computed_tokens)
        req.num_computed_tokens = 0
        req.snapshot = None
        self.move(req, WAITING)

    # ----------------------------------------------------------- copies

    def start_offload(self, req: Request, to: RequestStatus = OFFLOADING) -> OffloadCommand:
        """OFFLOADING (or HANDING_OFF): its blocks stay allocated until
        `finish_offload` (`finish_handoff`)."""
        num_tokens = req.num_computed_tokens
        num_blocks = self.kv.num_blocks_for(num_tokens)
        snapshot_id = self._new_id(req)
        req.snapshot = Snapshot(snapshot_id, num_tokens, num_blocks)
        self.move(req, to)
        self.copies[snapshot_id] = req
        return OffloadCommand(req.request_id, snapshot_id, req.block_ids[:num_blocks], num_tokens)

    def finish_offload(self, cmd: OffloadCommand, num_bytes: int | None) -> Request:
        """The snapshot is committed (num_bytes) or the copy failed (None):
        OFFLOADED, or WAITING to recompute; an aborted request just lets go."""
        req = self._take_copy(cmd.snapshot_id, OFFLOADING)
        self.kv.free(req)
        snapshot = req.snapshot
        assert snapshot is not None
        if req.status is FINISHED_ABORTED:
            if num_bytes is not None:
                self._drop_snapshot(req)
            req.snapshot = None
        elif num_bytes is None:
            self.counters.num_offload_failures += 1
            self.recompute(req)
        else:
            snapshot.num_bytes = num_bytes
            req.bytes_offloaded += num_bytes
            self.counters.bytes_offloaded += num_bytes
            self.move(req, OFFLOADED)
        return req

    def start_restore(self, req: Request) -> RestoreCommand | None:
        """RESUMING into fresh blocks; None (nothing changed) if they are not free."""
        snapshot = req.snapshot
        assert snapshot is not None
        block_ids = self.kv.allocate_fresh(req, snapshot.num_blocks)
        if block_ids is None:
            return None
        self.move(req, RESUMING)
        self.copies[snapshot.snapshot_id] = req
        return RestoreCommand(req.request_id, snapshot.snapshot_id, list(block_ids))

    def finish_restore(self, cmd: RestoreCommand, num_bytes: int | None) -> Request:
        """The snapshot's num_bytes are back in req's blocks, the snapshot
        consumed: RUNNING_DECODE; or the copy failed (None): WAITING to
        recompute, the snapshot deleted. A decode instance's hand-in that
        failed is given back instead (FINISHED_ABORTED, not counted): its
        snapshot is its prefill instance's, which decodes from it (or
        hands it off again) and deletes it."""
        req = self._take_copy(cmd.snapshot_id, RESUMING)
        snapshot = req.snapshot
        assert snapshot is not None
        if num_bytes is None and not snapshot.handed_in:
            self._drop_snapshot(req)
        req.snapshot = None
        if req.status is FINISHED_ABORTED:
            self.kv.free(req)
        elif num_bytes is not None:
            if snapshot.handed_in:
                self.counters.bytes_handed_in += num_bytes
            else:
                self.counters.bytes_restored += num_bytes
            self.move(req, RUNNING_DECODE)
            self.kv.cache_full_blocks(req)
        else:
            self.counters.num_restore_failures += 1
            if snapshot.handed_in:
                self.kv.free(req)
                self.move(req, FINISHED_ABORTED, counted=False)
            else:
                self.recompute(req)
        return req

    # ------------------------------------------------------ prefix tier

    def start_load(self, req: Request) -> str:
        """An admitted request (its blocks allocated) waits in LOADING for
        prefix-tier segments; returns the load's id."""
        load_id = self._new_id(req)
        self.move(req, LOADING)
        self.loads[load_id] = req
        return load_id

    def finish_load(self, load_id: str, num_tokens: int) -> Request:
        """`num_tokens` more positions hold KV (loaded): RUNNING_PREFILL for the
        rest; an aborted request just lets go of its blocks."""
        req = self.loads.pop(load_id)
        if req.status is FINISHED_ABORTED:
            self.kv.free(req)
            return req
        req.num_computed_tokens += num_tokens
        self.kv.cache_full_blocks(req)
        self.move(req, RUNNING_PREFILL)
        return req

    # ------------------------------------------------------------- P/D

    def finish_handoff(self, cmd: OffloadCommand, num_bytes: int | None) -> Request:
        """Prefill instance: the snapshot for the decode instance is committed
        (num_bytes): HANDED_OFF; or the copy failed (None): RUNNING_DECODE
        again, here, its blocks kept, or WAITING to recompute once its seat
        (freed when the copy began) went to another request."""
        req = self._take_copy(cmd.snapshot_id, HANDING_OFF)
        snapshot = req.snapshot
        assert snapshot is not None
        if req.status is FINISHED_ABORTED:
            self.kv.free(req)
            if num_bytes is not None:
                self._drop_snapshot(req)
            req.snapshot = None
        elif num_bytes is None:
            self.counters.num_handoff_failures += 1
            req.snapshot = None
            if self.num_running < self.config.max_num_seqs:
                self.move(req, RUNNING_DECODE)
            else:
                self.recompute(req)
        else:
            self.kv.free(req)
            snapshot.num_bytes = num_bytes
            self.counters.num_handoffs += 1
            self.counters.bytes_handed_off += num_bytes
            self.move(req, HANDED_OFF)
        return req

    def take_back(self, req: Request) -> None:
        """Prefill instance: the decode instance was lost. Finished here: from
        the snapshot if no token came back (OFFLOADED; a snapshot it already
        read fails the restore, which recomputes), else recomputed (WAITING)."""
        self.counters.num_handoff_failures += 1
        if req.num_computed_tokens == req.num_tokens - 1:
            self.move(req, OFFLOADED)
        else:
            self._drop_snapshot(req)
            self.recompute(req)

    def finish_remote(self, req: Request, status: RequestStatus) -> None:
        """Prefill instance: a HANDED_OFF request finished on its decode
        instance (FINISHED_STOPPED or FINISHED_LENGTH), which read its snapshot."""
        req.snapshot = None  # consumed there: nothing to delete
        self.move(req, status, counted=False)  # it holds no blocks; counted where it ended

    def start_remote_decode(
        self, req: Request, snapshot_id: str, first_token_id: int
    ) -> RestoreCommand:
        """Decode instance: the prefill instance's snapshot of req's prompt
        goes into its reserved blocks; RESUMING with its first token."""
        req.output_token_ids.append(first_token_id)
        req.num_computed_tokens = req.num_prompt_tokens
        req.snapshot = Snapshot(snapshot_id, req.num_prompt_tokens, len(req.block_ids),
                                handed_in=True)
        self.move(req, RESUMING)
        self.copies[snapshot_id] = req
        return RestoreCommand(req.request_id, snapshot_id, list(req.block_ids))

    def _new_id(self, req: Request) -> str:
        """A snapshot (or load) id unique to this scheduler."""
        self._num_snapshots += 1
        return snapshot_id_for(self.config.snapshot_id_prefix, req.request_id,
                               self._num_snapshots - 1)

    def _take_copy(self, snapshot_id: str, status: RequestStatus) -> Request:
        """The request whose copy (its status says which kind) just landed."""
        req = self.copies.get(snapshot_id)
        if req is None or req.status not in (status, FINISHED_ABORTED):
            raise FailedPrecondition(
                f"no copy of snapshot {snapshot_id} is in flight for a {status.value} request")
        del self.copies[snapshot_id]
        return req

    def _drop_snapshot(self, req: Request) -> None:
        if req.snapshot is not None:
            self._snapshots_to_delete.append(req.snapshot.snapshot_id)
            req.snapshot = None

    def take_snapshots_to_delete(self) -> list[str]:
        snapshot_ids = self._snapshots_to_delete
        self._snapshots_to_delete = []
        return snapshot_ids

    # ---------------------------------------------------------- counts

    @property
    def num_running(self) -> int:
        """Requests that count against max_num_seqs (a HANDING_OFF one no
        longer needs the worker)."""
        return (len(self.prefilling) + len(self.decoding) + len(self.resuming)
                + len(self.loading) + len(self.reserved))

    @property
    def num_preempted(self) -> int:
        return len(self.offloading) + len(self.offloaded) + len(self.resuming)

    @property
    def is_idle(self) -> bool:
        """No request held, no copy in flight, no snapshot left to delete."""
        return (not self.requests and not self.copies and not self.loads
                and not self._snapshots_to_delete)
