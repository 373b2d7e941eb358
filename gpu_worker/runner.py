"""ModelRunner: the model, the paged KV-cache tensor and the step loop.

Domain-level only (no grpc, no protos): the server converts plans into `SeqWork`
and calls `execute`. Every input is validated before anything is written, so
a rejected step leaves the cache untouched.

A step (`execute`) is: pack every sequence's tokens on the host into one
staged buffer, one copy to the device, one forward over all rows
(`batched.py`), sampling of every sampling row on the device, and one copy of
the sampled ids back: the step's only host<->device sync. It is the worker's
one forward path; the per-sequence and plain causal forwards it is checked
against are the tests' oracle (tests/gpu_worker/oracle.py).

Calls are not thread-safe; the server funnels steps, gathers and scatters
through one thread so that a copy never races a step writing the same blocks.
The host block pool (`host_pool`) is the exception: it is thread-safe.
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gpu_worker import step_checks
from gpu_worker.attention import AttentionBackend
from gpu_worker.checkpoint import load_model
from gpu_worker.config import DEFAULT_HOST_POOL_BYTES, MAX_MODEL_LEN, ModelConfig, WorkerConfig
from gpu_worker.host_buffers import HostBlockPool
from gpu_worker.host_pinning import Key, cuda_regions
from gpu_worker.invariance import choose_forward
from gpu_worker.model import CausalLM
from gpu_worker.sampling import GREEDY, SamplingParams, sample_rows
from gpu_worker.step_inputs import StepStaging, pack_step
from kvstash.common.cpu import usable_cpus
from kvstash.common.layout import Layout
from kvstash.common.malloc_tuning import keep_large_tensors
from kvstash.common.units import GIB
from kvstash.errors import InvalidArgument

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SeqWork:
    """One sequence's share of a step: a prefill chunk or one decode token.

    positions: 0 ....... start_pos ........ start_pos+len(token_ids)-1
               [ in cache ][ computed now, KV written into block_ids ]
    """

    request_id: str
    token_ids: Sequence[int]  # tokens whose KV this step computes
    start_pos: int  # position of token_ids[0]
    block_ids: Sequence[int]  # block table covering every position up to the last
    sample: bool = False  # sample the token that follows the last position
    sampling: SamplingParams = field(default=GREEDY)  # used when sample is set


class ModelRunner:
    def __init__(self, model: CausalLM, *, block_size: int, num_blocks: int,
                 max_model_len: int | None = None, seed: int = 0, name: str = "tiny",
                 weights_id: str = "tiny-seed-0", tokenizer_json: str = "",
                 tokenizer_config_json: str = "", batch_invariant: bool = True,
                 row_tile: int | None = None, attention: AttentionBackend | None = None,
                 host_pool_bytes: int = DEFAULT_HOST_POOL_BYTES,
                 cuda_graph_rows: int | None = None) -> None:
        """batch_invariant: a row's numbers do not depend on the rest of its step
        (see batched.py): whole steps on CPU, else (or with `row_tile` set)
        tiles of `row_tile` rows (None = the device's default). Off: each op
        runs once over the unpadded rows, not invariant.
        attention: None = flash on CUDA in fp16/bf16, else torch.
        cuda_graph_rows: see BatchedForward.use_graphs (0: no CUDA graphs)."""
        cfg = model.config
        if max_model_len is not None and max_model_len > cfg.max_model_len:
            # Served anyway, the scheduler would admit (and the rotary table
            # reach) positions the model was never trained for; capped
            # quietly, a user would be told nothing of the shorter context.
            raise ValueError(f"max_model_len {max_model_len} is more than the model's own "
                             f"{cfg.max_model_len} (its max_position_embeddings)")
        if (max_model_len or cfg.max_model_len) > MAX_MODEL_LEN:
            raise ValueError(f"the model's max_position_embeddings {cfg.max_model_len} is more "
                             f"than the {MAX_MODEL_LEN} positions a worker serves: pass "
                             "--max-model-len")
        kv_shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        _check_fits(kv_shape, model.dtype, model.device)
        self.model = model
        self.name, self.weights_id = name, weights_id  # checkpoint.LoadedModel's
        self.tokenizer_json = tokenizer_json  # "" = byte-level tokenizer
        self.tokenizer_config_json = tokenizer_config_json  # "" = none
        self.model_config: ModelConfig = cfg
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len or cfg.max_model_len
        self._limits = step_checks.Limits(block_size, num_blocks, cfg.vocab_size,
                                          self.max_model_len)
        self.device = model.device
        self.dtype = model.dtype
        self.kv_cache = torch.zeros(kv_shape, dtype=model.dtype, device=model.device)
        self._process_gen = torch.Generator().manual_seed(seed)
        self.batched = choose_forward(model, block_size, self.max_model_len, batch_invariant,
                                      row_tile, attention)
        self.row_tile = self.batched.row_tile
        self.batched.use_graphs(cuda_graph_rows)
        self._staging = StepStaging(self.device)
        self._pinned_region: object | None = None  # see pin_host_memory
        self._pinned_key: Key | None = None
        self.host_pool = HostBlockPool(
            (cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim), model.dtype,
            pinned=self.device.type == "cuda", max_idle_bytes=host_pool_bytes)

    @property
    def layout(self) -> Layout:
        """Shape of one block; a snapshot of n blocks is [L, 2, n, block_size, heads, dim]."""
        cfg = self.model_config
        return Layout(cfg.num_layers, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                      str(self.dtype).removeprefix("torch."))

    # ---- validation -------------------------------------------------------

    def check_block_ids(self, block_ids: Sequence[int], what: str) -> None:
        step_checks.check_block_ids(block_ids, self.num_blocks, what)

    def check_step(self, seqs: Sequence[SeqWork]) -> None:
        """Every problem a step could hit, raised before any KV is written."""
        step_checks.check_step(seqs, self._limits)

    # ---- steps ------------------------------------------------------------

    def execute(self, seqs: Sequence[SeqWork]) -> list[int | None]:
        """Runs one step; the sampled token per sequence (None where sample is unset)."""
        self.check_step(seqs)
        if not seqs:
            return []
        host = pack_step(seqs, self.block_size, self.row_tile, self._process_gen)
        step = self._staging.stage(host)
        hidden = self.batched.hidden(step, self.kv_cache)
        out: list[int | None] = [None] * len(seqs)
        if not host.num_sampled:
            return out
        logits = self.batched.logits(hidden[step.sample_rows])
        tokens = sample_rows(logits, step.sampling, self.row_tile)
        sampled = [i for i, seq in enumerate(seqs) if seq.sample]
        for i, token in zip(sampled, tokens[: host.num_sampled].tolist(), strict=True):
            out[i] = token
        return out

    def logits(self, seqs: Sequence[SeqWork]) -> torch.Tensor:
        """The batched path's logits after each sequence's last token, [len(seqs),
        vocab], running the step (its KV is written; nothing is sampled)."""
        self.check_step(seqs)
        host = pack_step(seqs, self.block_size, self.row_tile, self._process_gen)
        step = self._staging.stage(host)
        hidden = self.batched.hidden(step, self.kv_cache)
        rows = torch.zeros(host.num_rows, dtype=torch.long, device=self.device)
        rows[: len(seqs)] = torch.from_numpy(host.query_start[1:] - 1).to(self.device)
        return self.batched.logits(hidden[rows])[: len(seqs)]

    # ---- block copies for offload / restore -------------------------------

    def pin_host_memory(self, region: object) -> None:
        """On CUDA, registers `region` (a host mapping: the cache's arena) as
        pinned memory, so copies to and from it are DMA; lets go of the
        previous region (`host_pinning`). Nothing on CPU. Compute thread
        only: a failed registration's error is cleared on this thread."""
        if self.device.type != "cuda" or region is self._pinned_region:
            return
        regions = cuda_regions()
        if self._pinned_key is not None:
            regions.release(self._pinned_key)
        self._pinned_region, self._pinned_key = region, regions.acquire(region)

    def empty_host_blocks(self, num_blocks: int) -> torch.Tensor:
        """A new host buffer for `num_blocks` blocks, pinned when the cache lives on
        a GPU (so copies are DMA, not staged through pageable memory). Offload and
        restore borrow from the pool instead (`host_pool`)."""
        shape = (*self.kv_cache.shape[:2], num_blocks, *self.kv_cache.shape[3:])
        return torch.empty(shape, dtype=self.dtype, pin_memory=self.device.type == "cuda")

    def check_copy_blocks(self, block_ids: Sequence[int], what: str) -> None:
        """The blocks of a gather or scatter: at least one, each in range, none
        twice (so never more than the cache holds). Checked before any host
        buffer is sized by them. More ids than the pool holds are refused by
        their count, before any is read: a message may carry millions, which
        would hold the event loop (health, transfers) for seconds."""
        if not block_ids:
            raise InvalidArgument(f"{what}: no block ids given")
        if len(block_ids) > self.num_blocks:
            raise InvalidArgument(f"{what}: {len(block_ids)} block ids, more than the "
                                  f"{self.num_blocks} blocks of this worker")
        self.check_block_ids(block_ids, what)
        if len(set(block_ids)) != len(block_ids):
            repeats = [b for b, n in Counter(block_ids).items() if n > 1]
            raise InvalidArgument(f"{what}: block ids {repeats[:8]} repeat")

    def _index(self, block_ids: Sequence[int], what: str) -> torch.Tensor:
        self.check_copy_blocks(block_ids, what)
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.device)

    def _check_host(self, host: torch.Tensor, num_blocks: int, what: str) -> None:
        want = (*self.kv_cache.shape[:2], num_blocks, *self.kv_cache.shape[3:])
        if tuple(host.shape) != want or host.dtype != self.dtype:
            raise InvalidArgument(
                f"{what}: got {host.dtype} {list(host.shape)}, want {self.dtype} {list(want)}"
            )

    def gather_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks, in the given order, as one new contiguous host tensor
        [L, 2, len(block_ids), block_size, kv_heads, head_dim]."""
        host = self.empty_host_blocks(len(block_ids))
        self.gather_blocks_into(block_ids, host)
        return host

    def gather_blocks_into(self, block_ids: Sequence[int], host: torch.Tensor) -> None:
        """Like gather_blocks, into `host` (e.g. a buffer lent by host_pool).
        Returns once the copy is complete."""
        index = self._index(block_ids, "gather")
        self._check_host(host, len(block_ids), "gather")
        host.copy_(self.kv_cache.index_select(2, index))

    def scatter_blocks(self, block_ids: Sequence[int], host: torch.Tensor) -> None:
        """Writes host blocks (as `gather_blocks` returns them) into `block_ids`.
        Returns once `host` has been read (it may then go back to its pool)."""
        index = self._index(block_ids, "scatter")
        self._check_host(host, len(block_ids), "scatter")
        self.kv_cache.index_copy_(2, index, host.to(self.device))


def _check_fits(kv_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """A KV cache larger than all of the device's memory (on the CPU: of the
    host's RAM) is a mistaken num_blocks, said as one rather than as an
    allocation error. What is free is not checked: that changes."""
    need = math.prod(kv_shape) * dtype.itemsize
    have = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
            else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    if need > have:
        raise ValueError(f"num_blocks {kv_shape[2]} of {kv_shape[3]} tokens need a KV cache of "
                         f"{need / GIB:.1f} GiB, more than the {have / GIB:.1f} GiB of the "
                         f"{device.type} device")


def set_torch_threads(num_threads: int) -> int:
    """Sets torch's intra-op threads to `num_threads`, or where 0 to the CPUs
    this process may use; logs the count and where it came from; returns it.

    Inter-op threads go to 1: the worker runs one forward at a time on one
    thread and never forks torch work (torch.jit.fork), so that pool would
    only add idle threads. torch allows setting it once per process, before
    any inter-op work: build_runner calls this before the worker's first
    torch work."""
    if num_threads:
        why = "--num-threads (KVSTASH_WORKER_NUM_THREADS)"
    else:
        usable = usable_cpus()
        num_threads, why = usable.num_cpus, usable.reason
    torch.set_num_threads(num_threads)
    if torch.get_num_interop_threads() != 1:  # a second runner in one process (tests)
        torch.set_num_interop_threads(1)
    log.info("%d torch threads: %s", num_threads, why)
    return num_threads


def build_runner(config: WorkerConfig) -> ModelRunner:
    """Sets torch's threads (and, on the CPU, malloc's: keep_large_tensors),
    loads the configured model and allocates its KV cache."""
    set_torch_threads(config.num_threads)
    loaded = load_model(config)
    if loaded.model.device.type == "cpu":
        keep_large_tensors()
    return ModelRunner(loaded.model, block_size=config.block_size, num_blocks=config.num_blocks,
                       max_model_len=config.max_model_len, seed=config.seed, name=loaded.name,
                       weights_id=loaded.weights_id, tokenizer_json=loaded.tokenizer_json,
                       tokenizer_config_json=loaded.tokenizer_config_json,
                       batch_invariant=config.batch_invariant, row_tile=config.row_tile,
                       host_pool_bytes=config.host_pool_bytes,
                       cuda_graph_rows=config.cuda_graph_rows)

