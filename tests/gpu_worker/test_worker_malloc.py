"""keep_large_tensors: with its thresholds, repeated prefill steps reuse their
pages; with the worker's other settings alone (tune_malloc) every step faults
in its large tensors' pages again."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.gpu_worker.worker_factories import REPO

SCRIPT = """
import resource, sys, tempfile, torch
from pathlib import Path
from bench.worker_bench import load, make_runner, prefill, prompts, tables
from kvstash.common.malloc_tuning import keep_large_tensors, tune_malloc
assert tune_malloc()
if sys.argv[1] == "keep":
    assert keep_large_tensors()
torch.set_num_threads(1)
model = load("tiny", torch.float32, torch.device("cpu"), Path(tempfile.mkdtemp()))
runner = make_runner(model, "batched", 4, 1024)
ids, blocks = prompts(4, 1024, model.config.vocab_size), tables(4, 1024)
for _ in range(2):
    prefill(runner, ids, blocks, 4096, True)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    prefill(runner, ids, blocks, 4096, True)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def step_page_faults(mode: str) -> int:
    """Minor page faults over three 4 x 1,024-token prefill steps, after two."""
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    return int(out.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="mallopt and minor-fault counts: glibc on Linux only")
def test_repeated_steps_do_not_fault_their_pages_in_again() -> None:
    default = step_page_faults("default")
    assert default > 10_000  # each step maps its 38 MB score tensors afresh: this can fail
    # Measured: 1,356-7,116 against 112,376 (AVX-512 host); 8,648 against
    # 43,291 on the AMD host in a CI run. Without the thresholds they are alike.
    assert step_page_faults("keep") < default // 3
