"""Token-id prompts from a trace's hash ids: equal ids, equal tokens.

    hash_ids  [0,      14,     15    ]
    tokens    [blk(0) | blk(14) | blk(15)[:rest]]   each blk: block_tokens ids

Every id stands for a fixed pseudo-random block drawn from (seed, id) alone,
so two requests sharing a leading run of ids share exactly that prefix, and
a run is the same for the same seed whatever else is in the slice.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvstash.common.tokenizer import TINY_TEXT_IDS
from kvstash.workload.trace import Trace, TraceRequest

# Prompt tokens: ids every model here has, each one printable ASCII character
# to the byte tokenizer (the tiny model's), so a prompt can also be sent as
# text (OpenAI HTTP) and encode back to the same ids.
ALPHABET: tuple[int, ...] = TINY_TEXT_IDS


class PromptBuilder:
    def __init__(self, block_tokens: int, seed: int = 0,
                 alphabet: Sequence[int] = ALPHABET) -> None:
        if block_tokens <= 0 or not alphabet:
            raise ValueError(f"need block_tokens > 0 and an alphabet, got {block_tokens}, "
                             f"{len(alphabet)} ids")
        self.block_tokens = block_tokens
        self.seed = seed
        self.alphabet = alphabet
        self._blocks: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        if hash_id not in self._blocks:
            # A string seed is hashed with SHA-512: the same block in every process.
            rng = random.Random(f"{self.seed}:{hash_id}")
            self._blocks[hash_id] = rng.choices(self.alphabet, k=self.block_tokens)
        return self._blocks[hash_id]

    def prompt(self, request: TraceRequest) -> list[int]:
        needed = -(-request.input_length // self.block_tokens)
        if needed > len(request.hash_ids):
            raise ValueError(f"{request.input_length} tokens need {needed} blocks of "
                             f"{self.block_tokens}, the request has {len(request.hash_ids)} ids")
        tokens = [t for i in request.hash_ids[:needed] for t in self.block(i)]
        return tokens[:request.input_length]


def build_prompts(trace: Trace, seed: int = 0) -> list[list[int]]:
    builder = PromptBuilder(trace.block_tokens, seed)
    return [builder.prompt(r) for r in trace.requests]
