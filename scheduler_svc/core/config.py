"""Scheduler configuration: one frozen dataclass, validated once at start-up.

Nothing here reads the environment; the service's entry point builds a
`SchedulerConfig` from its flags/`KVSTASH_*` variables and hands it over.
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field
from typing import TypeVar

from kvstash.common.ids import check_snapshot_id
from kvstash.errors import InvalidArgument

E = TypeVar("E", bound=enum.Enum)

_MAX_PREFIX_CHARS = 32


class ReservationPolicy(enum.Enum):
    """How many blocks admission keeps back for each running decode request."""

    NEW_TOKEN_RATIO = "new_token_ratio"  # min(remaining, clip) * new_token_ratio tokens
    FIXED_BLOCKS = "fixed_blocks"  # fixed_blocks_per_decode blocks


class PrefixWrite(enum.Enum):
    THROUGH = "through"
    BACK = "back"


class Role(enum.Enum):
    """What this instance does in P/D disaggregation (core/pd.py)."""

    MIXED = "mixed"  # prefills and decodes its requests: no P/D at all
    PREFILL = "prefill"  # hands prefilled requests off to decode instances
    DECODE = "decode"  # reserves blocks for, and decodes, a prefill instance's requests


class PreemptionMode(enum.Enum):
    """What happens to a preempted decode request's KV blocks."""

    # Offload a victim when the cache service answers and offload + restore is
    # predicted cheaper than recompute (core/costs.py); until both are measured
    # (min_cost_samples), offload. A refused or failed copy means recompute.
    AUTO = "auto"
    OFFLOAD = "offload"  # always try to offload; failures fall back to recompute
    RECOMPUTE = "recompute"  # drop the blocks; prefill prompt + output again later


# Policies by name, as the benchmarks and the simulator compare them: how a
# preempted decode's KV comes back, and how admission reserves blocks for
# running decodes. "-fixed": a fixed number of blocks per running decode
# (fixed_blocks_per_decode) instead of its expected growth (new_token_ratio):
# it admits more and preempts more.
POLICIES: dict[str, tuple[PreemptionMode, ReservationPolicy]] = {
    mode.value + suffix: (mode, reservation)
    for suffix, reservation in (("", ReservationPolicy.NEW_TOKEN_RATIO),
                                ("-fixed", ReservationPolicy.FIXED_BLOCKS))
    for mode in (PreemptionMode.RECOMPUTE, PreemptionMode.OFFLOAD, PreemptionMode.AUTO)
}


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        # ValueError, not TypeError: every bad setting fails the same way at start-up.
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_float(name: str, value: object, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # Blocks in the worker's paged KV cache (the whole pool).
    num_blocks: int
    # Tokens per KV block.
    block_size: int
    # Longest sequence (prompt + max_tokens) the model accepts.
    max_model_len: int
    # Token ids must lie in [0, vocab_size).
    vocab_size: int
    # Tokens that finish a request unless its sampling says ignore_eos.
    eos_token_ids: tuple[int, ...] = ()
    # Most requests running (prefill, decode or resuming) at once.
    max_num_seqs: int = 64
    # Most requests waiting for admission; one more is refused (RESOURCE_EXHAUSTED)
    # instead of growing the queue without bound. Requeued preempted requests
    # always get back in.
    max_num_waiting: int = 1024
    # Per-step token budget shared by decodes (1 each) and prefill chunks;
    # a long prompt is split into chunks by this budget.
    max_num_batched_tokens: int = 512
    # Which formula admission uses to hold blocks back for running decodes.
    reservation_policy: ReservationPolicy = ReservationPolicy.NEW_TOKEN_RATIO
    # Blocks held back per running decode under FIXED_BLOCKS.
    fixed_blocks_per_decode: int = 1
    # new_token_ratio at start and whenever the scheduler goes idle.
    init_new_token_ratio: float = 0.7
    # The ratio decays down to init * this factor.
    min_new_token_ratio_factor: float = 0.14
    # Steps the linear decay takes from init to min.
    new_token_ratio_decay_steps: int = 600
    # Remaining output tokens counted per request are clipped to this.
    clip_max_new_tokens: int = 4096
    # Steps of progress credited per decode request when the ratio is
    # recomputed after a preemption.
    retract_steps: int = 20
    # What preemption does with a victim's KV.
    preemption_mode: PreemptionMode = PreemptionMode.AUTO
    # Bytes of one KV block across all layers, for sizing snapshots; 0 = unknown.
    bytes_per_block: int = 0
    # AUTO weighs offload against recompute only after this many successful
    # offloads, restores and steps with a prefill chunk were timed; before, it
    # offloads (as when the prediction is unusable): offloading is how the copy
    # rates get measured at all, and it recomputes nothing.
    min_cost_samples: int = 4
    # Blocks per running decode request kept free, on top of its reservation,
    # before an offloaded request resumes (one step of growth each).
    resume_headroom: int = 1
    # P/D disaggregation: a PREFILL or DECODE scheduler composes a P/D manager
    # (core/pd.py); a MIXED one has none.
    role: Role = Role.MIXED
    # P/D, decode instance: seconds a block reservation waits for its KV
    # before its blocks go back (the prefill instance died or gave up).
    reservation_timeout_s: float = 30.0
    # Starts every snapshot id, so that schedulers sharing a cache service (or
    # one restarted with its disk tier intact) never reuse each other's ids.
    snapshot_id_prefix: str = field(default_factory=lambda: secrets.token_hex(6))
    # The prefix tier (prefix_tier.py): blocks per prompt segment kept in the
    # cache service; 0: no tier. Its salt names the model, dtype and KV layout
    # (the edge makes it from the worker's info); segments with another salt
    # are never read.
    prefix_segment_blocks: int = 0
    prefix_tier_salt: str = ""
    # When segments are written: as soon as a prompt is prefilled (through),
    # or when the pool is about to evict them (back).
    prefix_write: PrefixWrite = PrefixWrite.THROUGH

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_model_len", "vocab_size", "max_num_seqs",
                     "max_num_waiting"):
            _check_int(name, getattr(self, name), 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, self.max_num_seqs)
        _check_int("new_token_ratio_decay_steps", self.new_token_ratio_decay_steps, 1)
        _check_int("clip_max_new_tokens", self.clip_max_new_tokens, 1)
        _check_int("min_cost_samples", self.min_cost_samples, 1)
        for name in ("fixed_blocks_per_decode", "retract_steps", "bytes_per_block",
                     "resume_headroom", "prefix_segment_blocks"):
            _check_int(name, getattr(self, name), 0)
        _check_float("init_new_token_ratio", self.init_new_token_ratio, 1e-9, 1.0)
        _check_float("min_new_token_ratio_factor", self.min_new_token_ratio_factor, 0.0, 1.0)
        _check_float("reservation_timeout_s", self.reservation_timeout_s, 1e-3, 86400.0)
        _check_snapshot_prefix(self.snapshot_id_prefix)
        if self.prefix_segment_blocks and not self.prefix_tier_salt:
            raise ValueError("a prefix tier (prefix_segment_blocks > 0) needs a prefix_tier_salt "
                             "naming the model and KV layout")
        eos = tuple(self.eos_token_ids)
        for token_id in eos:
            _check_int("eos_token_ids entry", token_id, 0)
            if token_id >= self.vocab_size:
                raise ValueError(f"eos token id {token_id} is outside vocab_size {self.vocab_size}")
        object.__setattr__(self, "eos_token_ids", eos)
        policy = _coerce(ReservationPolicy, "reservation_policy", self.reservation_policy)
        object.__setattr__(self, "reservation_policy", policy)
        object.__setattr__(self, "preemption_mode",
                           _coerce(PreemptionMode, "preemption_mode", self.preemption_mode))
        object.__setattr__(self, "role", _coerce(Role, "role", self.role))
        object.__setattr__(self, "prefix_write",
                           _coerce(PrefixWrite, "prefix_write", self.prefix_write))

    @property
    def max_servable_len(self) -> int:
        """The longest sequence (prompt + output) a request can have here:
        max_model_len, or fewer where the whole pool holds fewer tokens
        (intake refuses a request that needs more blocks than the pool)."""
        return min(self.max_model_len, self.num_blocks * self.block_size)

    @property
    def min_new_token_ratio(self) -> float:
        return self.init_new_token_ratio * self.min_new_token_ratio_factor

    @property
    def new_token_ratio_decay(self) -> float:
        """How much the ratio drops per step."""
        return (self.init_new_token_ratio - self.min_new_token_ratio) / (
            self.new_token_ratio_decay_steps
        )


def _check_snapshot_prefix(prefix: str) -> None:
    """The prefix starts snapshot ids, whose parts "." separates."""
    try:
        check_snapshot_id(prefix)
    except InvalidArgument as exc:
        raise ValueError(f"snapshot_id_prefix: {exc}") from None
    if "." in prefix or len(prefix) > _MAX_PREFIX_CHARS:
        raise ValueError(f"snapshot_id_prefix must be 1-{_MAX_PREFIX_CHARS} chars without "
                         f"'.', got {prefix!r}")


def _coerce(enum_type: type[E], name: str, value: object) -> E:
    """Accept the enum member or its string value ("auto", "fixed_blocks")."""
    if isinstance(value, enum_type):
        return value
    try:
        return enum_type(value)
    except ValueError:
        choices = ", ".join(str(m.value) for m in enum_type)
        raise ValueError(f"{name} must be one of {choices}, got {value!r}") from None
