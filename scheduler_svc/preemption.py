"""Preempted decode requests: offload, resume, or fall back to recompute.

    RUNNING_DECODE --preempt--> OFFLOADING --finish_offload--> OFFLOADED --resume--> RESUMING
        |                           |  (committed)                                   |  |
        |                           +-- refused / failed --+      finish_restore(ok) -+  |
        +-- no room in the cache ------------------------->+-> WAITING (recompute)      |
                                                           ^-- finish_restore(failed) --+

The Scheduler owns WAITING and the running queues; this module owns the three
preempted queues, the snapshots, the deletion queue and the transfer
accounting. Every operation that hands a request back leaves it in the status
that says where it goes: WAITING (front of the queue, output kept, KV to be
recomputed), RUNNING_DECODE, or FINISHED_ABORTED (forget it).

A copy in flight pins its blocks: an OFFLOADING request's blocks are freed only
once the cache service has committed or refused the snapshot, and an aborted
request's copy is still waited for.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence

from kvstash.errors import FailedPrecondition, InvalidArgument
from scheduler_svc.config import PreemptionMode, SchedulerConfig
from scheduler_svc.kv_manager import KVCacheManager
from scheduler_svc.outputs import OffloadCommand, RestoreCommand
from scheduler_svc.request import Request, RequestStatus, Snapshot
from scheduler_svc.reservation import Reservation

_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9._-]")

WAITING = RequestStatus.WAITING
RUNNING_DECODE = RequestStatus.RUNNING_DECODE
OFFLOADING = RequestStatus.OFFLOADING
OFFLOADED = RequestStatus.OFFLOADED
RESUMING = RequestStatus.RESUMING
FINISHED_ABORTED = RequestStatus.FINISHED_ABORTED


class Preemption:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, reservation: Reservation
    ) -> None:
        self.config = config
        self.kv = kv
        self.reservation = reservation
        # Copies in flight, aborted requests included.
        self.offloading: dict[str, Request] = {}
        self.resuming: dict[str, Request] = {}
        # OFFLOADED, in arrival order: they resume ahead of later arrivals.
        self.offloaded: list[Request] = []
        self._snapshots_to_delete: list[str] = []
        self._num_snapshots = 0
        # Free bytes the cache service last reported (None: unreachable), and
        # what has been spent from that report since: estimated bytes of
        # offloads in flight plus bytes committed.
        self._capacity: int | None = None
        self._bytes_in_flight = 0
        self._bytes_since_report = 0
        self.num_preemptions_offload = 0
        self.num_preemptions_recompute = 0
        self.num_offload_failures = 0
        self.num_restore_failures = 0
        self.bytes_offloaded = 0
        self.bytes_restored = 0

    # ------------------------------------------------------------- preempt

    def preempt_for_decodes(
        self, decoding: Sequence[Request]
    ) -> tuple[list[Request], list[OffloadCommand]]:
        """Preempts decode requests until every other one can get its next block,
        counting blocks of offloads in flight as soon free. Victims: shortest
        output, then longest prompt; one decode always keeps running. Returns the
        victims (now OFFLOADING or WAITING) and the copies to make."""
        pool = self.kv.pool
        victims: list[Request] = []
        offloads: list[OffloadCommand] = []
        if pool.num_allocatable_blocks >= len(decoding):
            return victims, offloads
        block_size = self.config.block_size
        num_needed = sum(
            1 for r in decoding if r.num_computed_tokens >= len(r.block_ids) * block_size
        )
        num_soon_free = self.num_soon_free_blocks()
        if num_needed <= pool.num_allocatable_blocks + num_soon_free:
            return victims, offloads
        by_progress = sorted(
            decoding, key=lambda r: (len(r.output_token_ids), -r.num_prompt_tokens)
        )
        for victim in by_progress[:-1]:
            if num_needed <= pool.num_allocatable_blocks + num_soon_free:
                break
            if victim.num_computed_tokens >= len(victim.block_ids) * block_size:
                num_needed -= 1
            victims.append(victim)
            offload = self.preempt(victim)
            if offload is not None:
                offloads.append(offload)
                num_soon_free += self.kv.num_exclusive_blocks(victim)
        return victims, offloads

    def can_offload(self, num_bytes: int) -> bool:
        mode = self.config.preemption_mode
        if mode is PreemptionMode.RECOMPUTE:
            return False
        if mode is PreemptionMode.OFFLOAD:
            return True
        if self._capacity is None:
            return False
        return num_bytes <= self._capacity - self._bytes_in_flight - self._bytes_since_report

    def preempt(self, victim: Request) -> OffloadCommand | None:
        """Offloads a decode request (OFFLOADING, blocks kept until the copy lands)
        and returns the copy to make, or drops its KV at once (WAITING) and returns None."""
        victim.num_preemptions += 1
        num_tokens = victim.num_computed_tokens
        num_blocks = self.kv.num_blocks_for(num_tokens)
        num_bytes = num_blocks * self.config.bytes_per_block
        if not self.can_offload(num_bytes):
            self.num_preemptions_recompute += 1
            self._to_recompute(victim)
            return None
        self.num_preemptions_offload += 1
        safe_id = _UNSAFE_ID_CHARS.sub("_", victim.request_id)[:64]
        snapshot_id = f"{self.config.snapshot_id_prefix}.{safe_id}.{self._num_snapshots}"
        self._num_snapshots += 1
        victim.snapshot = Snapshot(snapshot_id, num_tokens, num_blocks)
        victim.status = OFFLOADING
        self.offloading[victim.request_id] = victim
        self._bytes_in_flight += num_bytes
        return OffloadCommand(
            victim.request_id, snapshot_id, victim.block_ids[:num_blocks], num_tokens
        )

    def num_soon_free_blocks(self) -> int:
        """Blocks that offloads in flight release once they land."""
        kv = self.kv
        return sum(kv.num_exclusive_blocks(r) for r in self.offloading.values())

    def _to_recompute(self, req: Request) -> None:
        """Drops req's KV and snapshot; WAITING, output kept."""
        if req.block_ids:
            self.kv.free(req)
        req.recompute_until = max(req.recompute_until, req.num_computed_tokens)
        req.num_computed_tokens = 0
        req.snapshot = None
        req.status = WAITING

    # -------------------------------------------------------------- resume

    def resume(self, num_seats: int, headroom: int) -> list[RestoreCommand]:
        """Restores OFFLOADED requests, oldest first, while free blocks cover the
        snapshot plus `headroom` blocks for the running requests, and seats last."""
        pool = self.kv.pool
        offloaded = self.offloaded
        commands: list[RestoreCommand] = []
        while offloaded and len(commands) < num_seats:
            req = offloaded[0]
            snapshot = req.snapshot
            assert snapshot is not None
            if pool.num_allocatable_blocks < snapshot.num_blocks + headroom:
                break
            block_ids = self.kv.allocate_fresh(req, snapshot.num_blocks)
            assert block_ids is not None
            del offloaded[0]
            req.status = RESUMING
            self.resuming[req.request_id] = req
            commands.append(RestoreCommand(req.request_id, snapshot.snapshot_id, list(block_ids)))
            headroom += self.reservation.reserved_blocks(req) + self.config.resume_headroom
        return commands

    # ------------------------------------------------- transfers and aborts

    def abort(self, req: Request) -> bool:
        """Called after req was marked aborted; True if it holds nothing any more,
        False while a copy in flight still pins it (finish_* release it)."""
        if req.request_id in self.offloading or req.request_id in self.resuming:
            return False
        self.offloaded.remove(req)
        self._drop_snapshot(req)
        return True

    def finish_offload(self, req: Request, num_bytes: int | None) -> Request:
        """The snapshot is committed (num_bytes) or the copy failed (None)."""
        self._take_in_flight(self.offloading, req, "offload")
        snapshot = req.snapshot
        assert snapshot is not None
        self._bytes_in_flight -= snapshot.num_blocks * self.config.bytes_per_block
        self.kv.free(req)
        if req.status is FINISHED_ABORTED:
            if num_bytes is None:
                req.snapshot = None  # a failed put leaves nothing behind
            self._drop_snapshot(req)
        elif num_bytes is None:
            self.num_offload_failures += 1
            self._to_recompute(req)
        else:
            snapshot.num_bytes = num_bytes
            req.bytes_offloaded += num_bytes
            self.bytes_offloaded += num_bytes
            self._bytes_since_report += num_bytes
            req.status = OFFLOADED
            keys = [r.arrival_seq for r in self.offloaded]
            self.offloaded.insert(bisect.bisect(keys, req.arrival_seq), req)
        return req

    def finish_restore(self, req: Request, ok: bool) -> Request:
        """The snapshot is back in req's blocks (ok) or the copy failed."""
        self._take_in_flight(self.resuming, req, "restore")
        snapshot = req.snapshot
        assert snapshot is not None
        self._drop_snapshot(req)
        if req.status is FINISHED_ABORTED:
            self.kv.free(req)
        elif ok:
            self.bytes_restored += snapshot.num_bytes
            req.status = RUNNING_DECODE
            self.kv.cache_full_blocks(req)
        else:
            self.num_restore_failures += 1
            self._to_recompute(req)
        return req

    def _take_in_flight(self, in_flight: dict[str, Request], req: Request, what: str) -> None:
        if in_flight.get(req.request_id) is not req:
            raise FailedPrecondition(
                f"request {req.request_id} has no {what} in flight (status {req.status.value})"
            )
        del in_flight[req.request_id]

    def _drop_snapshot(self, req: Request) -> None:
        if req.snapshot is not None:
            self._snapshots_to_delete.append(req.snapshot.snapshot_id)
            req.snapshot = None

    def set_capacity(self, free_bytes: int | None) -> None:
        if free_bytes is not None and free_bytes < 0:
            raise InvalidArgument(f"free_bytes must be >= 0, got {free_bytes}")
        self._capacity = free_bytes
        self._bytes_since_report = 0

    def take_snapshots_to_delete(self) -> list[str]:
        snapshot_ids = self._snapshots_to_delete
        self._snapshots_to_delete = []
        return snapshot_ids

    @property
    def has_capacity_report(self) -> bool:
        """The cache service reported its free bytes (it is reachable)."""
        return self._capacity is not None

    @property
    def has_snapshots_to_delete(self) -> bool:
        return bool(self._snapshots_to_delete)

    # -------------------------------------------------------------- counts

    def num_live_offloading(self) -> int:
        return sum(1 for r in self.offloading.values() if r.status is OFFLOADING)

    def num_live_resuming(self) -> int:
        return sum(1 for r in self.resuming.values() if r.status is RESUMING)
