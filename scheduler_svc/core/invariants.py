"""What must hold between the scheduler's queues and its requests.

The table in lifecycle.py, checked: every held request sits in exactly one
queue, whose name fixes its status and what it may hold (blocks, snapshot);
every copy in flight belongs to a request in offloading, resuming or
handing_off, every prefix-tier load to one in loading, or either to an
aborted request that is in no queue. P/D (pd.py): only
a DECODE scheduler holds RESERVED requests, only a PREFILL one hands off, and
the requests its manager is to hand off are live and not yet handed off.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain

from kvstash.errors import IntegrityError
from scheduler_svc.core.config import Role, SchedulerConfig
from scheduler_svc.core.lifecycle import Lifecycle
from scheduler_svc.core.pd import PdManager
from scheduler_svc.core.prefix_tier import PrefixTier
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.reservation import Reservation

_ALLOWED = {
    "waiting": {RequestStatus.WAITING},
    "prefilling": {RequestStatus.RUNNING_PREFILL},
    "decoding": {RequestStatus.RUNNING_DECODE},
    "offloading": {RequestStatus.OFFLOADING},
    "offloaded": {RequestStatus.OFFLOADED},
    "resuming": {RequestStatus.RESUMING},
    "loading": {RequestStatus.LOADING},
    "reserved": {RequestStatus.RESERVED},
    "handing_off": {RequestStatus.HANDING_OFF},
    "handed_off": {RequestStatus.HANDED_OFF},
}
_COPYING = ("offloading", "resuming", "handing_off")
_WITH_SNAPSHOT = (*_COPYING, "offloaded", "handed_off")


def check_scheduler(
    config: SchedulerConfig, life: Lifecycle, reservation: Reservation, pd: PdManager | None,
    tier: PrefixTier | None,
) -> None:
    """Every invariant of a scheduler's state; raises IntegrityError naming the first broken."""
    check_requests(config, queues_of(life), life.requests, life.copies)
    check_loads(life)
    check_pd(config.role, life, pd)
    holders = chain(life.prefilling.values(), life.decoding.values(), life.reserved.values(),
                    life.copies.values(), life.loads.values())
    saves = () if tier is None else tier.saves.values()
    life.kv.pool.check_integrity(chain((r.block_ids for r in holders), saves))
    ratio = reservation.new_token_ratio
    if not 0 <= ratio <= config.init_new_token_ratio:
        raise IntegrityError(f"new_token_ratio {ratio} outside [0, init]")
    if life.num_running > config.max_num_seqs:
        raise IntegrityError(
            f"{life.num_running} requests running, max_num_seqs is {config.max_num_seqs}")


def queues_of(life: Lifecycle) -> dict[str, list[Request]]:
    """Every queue by name."""
    return {
        "waiting": list(life.waiting), "prefilling": list(life.prefilling.values()),
        "decoding": list(life.decoding.values()),
        "offloading": list(life.offloading.values()), "offloaded": list(life.offloaded),
        "resuming": list(life.resuming.values()), "loading": list(life.loading.values()),
        "reserved": list(life.reserved.values()),
        "handing_off": list(life.handing_off.values()),
        "handed_off": list(life.handed_off.values()),
    }


def check_loads(life: Lifecycle) -> None:
    """Every LOADING request has one load in flight; every load belongs to a
    LOADING request or an aborted one."""
    loading = {id(r) for r in life.loading.values()}
    for load_id, req in life.loads.items():
        if id(req) not in loading and req.status is not RequestStatus.FINISHED_ABORTED:
            raise IntegrityError(f"load {load_id} belongs to request {req.request_id} "
                                 f"with status {req.status.value}")
    num_live = sum(1 for r in life.loads.values() if not r.status.is_finished)
    if num_live != len(life.loading):
        raise IntegrityError(f"{num_live} live loads in flight, {len(life.loading)} requests "
                             "loading")


def check_pd(role: Role, life: Lifecycle, pd: PdManager | None) -> None:
    """P/D state only where the role has it; what the manager is to hand off
    is live, in the status that stage allows."""
    if (pd is None) != (role is Role.MIXED):
        raise IntegrityError(f"a {role.value} scheduler {'has' if pd else 'lacks'} a P/D manager")
    if life.reserved and role is not Role.DECODE:
        raise IntegrityError(f"a {role.value} scheduler holds reserved requests "
                             f"{sorted(life.reserved)}")
    if (life.handing_off or life.handed_off) and role is not Role.PREFILL:
        raise IntegrityError(f"a {role.value} scheduler hands off requests "
                             f"{sorted([*life.handing_off, *life.handed_off])}")
    if pd is None:
        return
    stages = ((pd.awaiting_prefill, (RequestStatus.WAITING, RequestStatus.RUNNING_PREFILL)),
              (pd.to_hand_off, (RequestStatus.RUNNING_DECODE,)))
    for held, allowed in stages:
        for rid, req in held.items():
            if life.requests.get(rid) is not req or req.status not in allowed:
                raise IntegrityError(f"request {rid}, to be handed off, is "
                                     f"{req.status.value} or not the registered request")
    if (pd.awaiting_prefill or pd.to_hand_off) and role is not Role.PREFILL:
        raise IntegrityError(f"a {role.value} scheduler is to hand off requests")


def check_requests(
    config: SchedulerConfig,
    queues: Mapping[str, Sequence[Request]],
    requests: Mapping[str, Request],
    copies: Mapping[str, Request],
) -> None:
    seen: dict[str, str] = {}
    for name, reqs in queues.items():
        for req in reqs:
            rid = req.request_id
            if rid in seen:
                raise IntegrityError(f"request {rid} is in both {seen[rid]} and {name}")
            seen[rid] = name
            if requests.get(rid) is not req:
                raise IntegrityError(f"request {rid} in {name} is not the registered request")
            if req.status not in _ALLOWED[name]:
                raise IntegrityError(f"request {rid} in {name} has status {req.status.value}")
            _check_request(config, name, req)
    lost = set(requests) - set(seen)
    if lost:
        raise IntegrityError(f"requests {sorted(lost)} are in no queue")
    for snapshot_id, req in copies.items():
        live = seen.get(req.request_id) in _COPYING and (
            requests.get(req.request_id) is req)
        if not live and req.status is not RequestStatus.FINISHED_ABORTED:
            raise IntegrityError(f"copy {snapshot_id} belongs to request {req.request_id} "
                                 f"with status {req.status.value}")
        if live and req.snapshot_id != snapshot_id:
            raise IntegrityError(f"copy {snapshot_id} belongs to request {req.request_id} "
                                 f"whose snapshot is {req.snapshot_id}")
    num_live_copies = sum(1 for r in copies.values() if not r.status.is_finished)
    num_copying = sum(len(queues[name]) for name in _COPYING)
    if num_live_copies != num_copying:
        raise IntegrityError(f"{num_live_copies} live copies in flight, {num_copying} "
                             "requests offloading, resuming or handing off")


def _check_request(config: SchedulerConfig, queue: str, req: Request) -> None:
    rid = req.request_id
    block_size = config.block_size
    num_blocks = len(req.block_ids)
    num_computed = req.num_computed_tokens

    def blocks_for(num_tokens: int) -> int:
        return -(-num_tokens // block_size)

    if not isinstance(req.prompt_token_ids, tuple):
        raise IntegrityError(f"request {rid}'s prompt is a {type(req.prompt_token_ids).__name__}")
    if req.num_cached_blocks > min(num_blocks, num_computed // block_size):
        raise IntegrityError(
            f"request {rid} caches {req.num_cached_blocks} blocks with {num_blocks} blocks "
            f"and {num_computed} computed tokens"
        )
    has_snapshot = req.snapshot is not None
    if has_snapshot != (queue in _WITH_SNAPSHOT):
        raise IntegrityError(f"request {rid} in {queue} has snapshot {req.snapshot_id}")
    if queue in ("waiting", "offloaded", "handed_off") and num_blocks:
        raise IntegrityError(f"request {rid} in {queue} holds {num_blocks} blocks")
    if queue == "waiting" and num_computed:
        raise IntegrityError(f"waiting request {rid} has {num_computed} computed tokens")
    if queue in ("prefilling", "loading") and (
        not num_computed < req.num_tokens or num_blocks != blocks_for(req.num_tokens)
    ):
        raise IntegrityError(
            f"{queue} request {rid}: {num_computed} of {req.num_tokens} tokens computed, "
            f"{num_blocks} blocks"
        )
    if queue == "reserved" and (
        num_computed or req.output_token_ids or num_blocks != blocks_for(req.num_prompt_tokens)
    ):
        raise IntegrityError(
            f"reserved request {rid}: {num_computed} computed tokens, "
            f"{len(req.output_token_ids)} output tokens, {num_blocks} blocks"
        )
    # A handed-off request's output grows on the decode instance, its KV does not.
    last_computed = (num_computed < req.num_tokens if queue == "handed_off"
                     else num_computed == req.num_tokens - 1)
    preempted_or_decoding = ("decoding", *_WITH_SNAPSHOT)
    if queue in preempted_or_decoding and not last_computed:
        raise IntegrityError(
            f"request {rid} in {queue}: {num_computed} computed tokens, {req.num_tokens} tokens"
        )
    if queue == "decoding" and not blocks_for(num_computed) <= num_blocks <= blocks_for(
        num_computed + 1
    ):
        raise IntegrityError(
            f"decoding request {rid}: {num_blocks} blocks for {num_computed} computed tokens"
        )
    if req.snapshot is not None:
        snapshot = req.snapshot
        if snapshot.num_tokens != num_computed or snapshot.num_blocks != blocks_for(num_computed):
            raise IntegrityError(
                f"request {rid}: snapshot of {snapshot.num_tokens} tokens / "
                f"{snapshot.num_blocks} blocks, {num_computed} tokens computed"
            )
        if queue in ("offloading", "handing_off") and num_blocks < snapshot.num_blocks:
            raise IntegrityError(f"offloading request {rid} holds {num_blocks} blocks")
        if queue == "resuming" and num_blocks != snapshot.num_blocks:
            raise IntegrityError(f"resuming request {rid} holds {num_blocks} blocks")
