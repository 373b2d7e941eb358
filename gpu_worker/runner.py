"""ModelRunner: the model, the paged KV-cache tensor and the step loop.

Domain-level only (no grpc, no protos): the server converts plans into `SeqWork`
and calls `execute`. Every input is validated before anything is written, so
a rejected step leaves the cache untouched.

Calls are not thread-safe; the server funnels steps, gathers and scatters
through one thread so that a copy never races a step writing the same blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gpu_worker.checkpoint import load_model
from gpu_worker.config import ModelConfig, WorkerConfig
from gpu_worker.model import CausalLM
from gpu_worker.sampling import GREEDY, SamplingParams, sample
from kvstash.errors import InvalidArgument


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


@dataclass(frozen=True, slots=True)
class KvLayoutSpec:
    """Shape of one block; a snapshot of n blocks is [L, 2, n, block_size, heads, dim]."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32", "bfloat16", ...


class ModelRunner:
    def __init__(self, model: CausalLM, *, block_size: int, num_blocks: int,
                 max_model_len: int | None = None, seed: int = 0, name: str = "tiny",
                 tokenizer_json: str = "") -> None:
        cfg = model.config
        self.model = model
        self.name = name
        self.tokenizer_json = tokenizer_json  # "" = byte-level tokenizer
        self.model_config: ModelConfig = cfg
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = min(cfg.max_model_len, max_model_len or cfg.max_model_len)
        self.device = model.device
        self.dtype = model.dtype
        self.kv_cache = torch.zeros(
            cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
            dtype=model.dtype, device=model.device,
        )
        self._process_gen = torch.Generator().manual_seed(seed)

    @property
    def layout(self) -> KvLayoutSpec:
        cfg = self.model_config
        return KvLayoutSpec(cfg.num_layers, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                            str(self.dtype).removeprefix("torch."))

    # ---- validation -------------------------------------------------------

    def check_block_ids(self, block_ids: Sequence[int], what: str) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise InvalidArgument(f"{what}: block ids {bad[:8]} outside [0, {self.num_blocks})")

    def _check_seq(self, seq: SeqWork) -> None:
        who = f"request {seq.request_id!r}"
        n = len(seq.token_ids)
        if n == 0:
            raise InvalidArgument(f"{who}: no token_ids to compute")
        vocab = self.model_config.vocab_size
        bad_tokens = [t for t in seq.token_ids if not 0 <= t < vocab]
        if bad_tokens:
            raise InvalidArgument(f"{who}: token ids {bad_tokens[:8]} outside vocab of {vocab}")
        end = seq.start_pos + n
        if seq.start_pos < 0 or end > self.max_model_len:
            raise InvalidArgument(
                f"{who}: positions {seq.start_pos}..{end - 1} exceed max_model_len "
                f"{self.max_model_len}"
            )
        need = -(-end // self.block_size)
        if len(seq.block_ids) < need:
            raise InvalidArgument(
                f"{who}: {end} positions need {need} blocks of {self.block_size}, "
                f"block table has {len(seq.block_ids)}"
            )
        self.check_block_ids(seq.block_ids, who)

    def check_step(self, seqs: Sequence[SeqWork]) -> None:
        """Every problem a step could hit, raised before any KV is written."""
        written: dict[int, str] = {}  # slot -> request writing it
        seen_requests: set[str] = set()
        for seq in seqs:
            if seq.request_id in seen_requests:
                raise InvalidArgument(f"request {seq.request_id!r} appears twice in one step")
            seen_requests.add(seq.request_id)
            self._check_seq(seq)
            for pos in range(seq.start_pos, seq.start_pos + len(seq.token_ids)):
                block, offset = divmod(pos, self.block_size)
                slot = seq.block_ids[block] * self.block_size + offset
                other = written.setdefault(slot, seq.request_id)
                if other != seq.request_id:
                    raise InvalidArgument(
                        f"requests {other!r} and {seq.request_id!r} both write block "
                        f"{slot // self.block_size} offset {slot % self.block_size}"
                    )

    # ---- steps ------------------------------------------------------------

    def execute(self, seqs: Sequence[SeqWork]) -> list[int | None]:
        """Runs one step; the sampled token per sequence (None where sample is unset)."""
        self.check_step(seqs)
        out: list[int | None] = []
        for seq in seqs:
            logits = self.forward(seq)
            if not seq.sample:
                out.append(None)
                continue
            position = seq.start_pos + len(seq.token_ids)
            out.append(sample(logits, seq.sampling, position, self._process_gen))
        return out

    def forward(self, seq: SeqWork, all_logits: bool = False) -> torch.Tensor:
        """Logits after the last token ([vocab]) or for every token ([n, vocab]).
        Trusts its input; `execute` validates."""
        tokens = torch.tensor(list(seq.token_ids), dtype=torch.long, device=self.device)
        table = torch.tensor(list(seq.block_ids), dtype=torch.long, device=self.device)
        return self.model.forward_paged(tokens, seq.start_pos, self.kv_cache, table, all_logits)

    # ---- block copies for offload / restore -------------------------------

    def empty_host_blocks(self, num_blocks: int) -> torch.Tensor:
        """A host buffer for `num_blocks` blocks, pinned when the cache lives on a GPU
        (so copies to and from it are DMA, not staged through pageable memory)."""
        shape = (*self.kv_cache.shape[:2], num_blocks, *self.kv_cache.shape[3:])
        return torch.empty(shape, dtype=self.dtype, pin_memory=self.device.type == "cuda")

    def _index(self, block_ids: Sequence[int], what: str) -> torch.Tensor:
        if not block_ids:
            raise InvalidArgument(f"{what}: no block ids given")
        self.check_block_ids(block_ids, what)
        if len(set(block_ids)) != len(block_ids):
            raise InvalidArgument(f"{what}: block ids {list(block_ids)} repeat")
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.device)

    def gather_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks, in the given order, as one contiguous host tensor
        [L, 2, len(block_ids), block_size, kv_heads, head_dim]."""
        index = self._index(block_ids, "gather")
        host = self.empty_host_blocks(len(block_ids))
        host.copy_(self.kv_cache.index_select(2, index))
        return host

    def scatter_blocks(self, block_ids: Sequence[int], host: torch.Tensor) -> None:
        """Writes host blocks (as `gather_blocks` returns them) into `block_ids`."""
        index = self._index(block_ids, "scatter")
        want = (*self.kv_cache.shape[:2], len(block_ids), *self.kv_cache.shape[3:])
        if tuple(host.shape) != want or host.dtype != self.dtype:
            raise InvalidArgument(
                f"scatter: got {host.dtype} {list(host.shape)}, want {self.dtype} {list(want)}"
            )
        self.kv_cache.index_copy_(2, index, host.to(self.device))


def build_runner(config: WorkerConfig) -> ModelRunner:
    """Loads the configured model and allocates its KV cache."""
    loaded = load_model(config)
    return ModelRunner(loaded.model, block_size=config.block_size, num_blocks=config.num_blocks,
                       max_model_len=config.max_model_len, seed=config.seed, name=loaded.name,
                       tokenizer_json=loaded.tokenizer_json)
