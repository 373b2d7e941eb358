"""Intake: what every new request goes through before the scheduler holds it.

`check` refuses a request that can never fit, with a clear error; anything
that passes can always be scheduled eventually (alone, with the whole pool),
so no request ever fails later because memory ran short. `create` stamps its
arrival: the clock's time and its place in the order of arrivals, which
preempted requests keep (lifecycle.py). A request added with `add_request`
and one reserved for a prefill instance (pd.py) come in the same way.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping, Sequence

from kvstash.common.sampling import SamplingParams
from kvstash.errors import AlreadyExists, InvalidArgument
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.request import Request, RequestStatus

# The largest id an array("I") holds: a vocabulary past it (kvstash sim's,
# whose tokens are trace hash ids) needs no max() over the prompt.
_MAX_ID = 2**32 - 1


class Intake:
    def __init__(
        self, config: SchedulerConfig, requests: Mapping[str, Request],
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self._requests = requests  # the live requests by id (Lifecycle.requests)
        self._clock = clock
        self._num_arrivals = 0

    def check(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> None:
        """InvalidArgument (check_new_request), AlreadyExists for a live id;
        changes nothing."""
        check_new_request(self.config, request_id, tuple(prompt_token_ids), sampling)
        if request_id in self._requests:
            raise AlreadyExists(f"request {request_id} already exists")

    def create(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
        status: RequestStatus = RequestStatus.WAITING,
    ) -> Request:
        """A new request, stamped with its arrival; not yet held by anyone."""
        req = Request.create(
            request_id, prompt_token_ids, sampling, arrival_time=self._clock(),
            arrival_seq=self._num_arrivals, eos_token_ids=self.config.eos_token_ids,
            status=status,
        )
        self._num_arrivals += 1
        return req


def check_new_request(
    config: SchedulerConfig, request_id: str, prompt: tuple[int, ...], sampling: SamplingParams
) -> None:
    """Raises InvalidArgument naming the bad value; returns None when the request fits.
    (Sampling values were checked when `sampling` was built.)"""
    if not prompt:
        raise InvalidArgument(f"request {request_id}: prompt is empty")
    vocab_size = config.vocab_size
    try:  # C loops: every id an int in [0, 2**32), the largest below the vocabulary
        ids = array("I", prompt)
        fits = vocab_size > _MAX_ID or max(ids) < vocab_size
    except (TypeError, OverflowError):
        fits = False
    if not fits:  # find the first bad id, for the message
        for pos, token_id in enumerate(prompt):
            if not (isinstance(token_id, int) and 0 <= token_id < vocab_size):
                raise InvalidArgument(
                    f"request {request_id}: token id {token_id!r} at position {pos} is "
                    f"outside the vocabulary [0, {vocab_size})"
                )
    if bad := [t for t in sampling.stop_token_ids if t >= vocab_size]:
        raise InvalidArgument(f"request {request_id}: stop token ids {bad[:8]} are outside "
                              f"the vocabulary [0, {vocab_size})")
    num_total = len(prompt) + sampling.max_tokens
    if num_total > config.max_model_len:
        raise InvalidArgument(
            f"request {request_id}: prompt of {len(prompt)} tokens + max_tokens "
            f"{sampling.max_tokens} = {num_total} exceeds max_model_len {config.max_model_len}"
        )
    num_blocks = -(-num_total // config.block_size)
    if num_blocks > config.num_blocks:
        raise InvalidArgument(
            f"request {request_id}: {num_total} tokens need {num_blocks} blocks, the whole "
            f"pool has {config.num_blocks} ({config.num_blocks * config.block_size} tokens)"
        )
