"""bench.worker_bench end to end on the tiny model, on the CPU: each mode's
row says how its steps ran, the kernel counts and the top ops are there."""

from __future__ import annotations

import json
from pathlib import Path

from bench.worker_bench import main


def test_the_bench_reports_each_modes_steps_kernels_and_top_ops(tmp_path: Path) -> None:
    out = tmp_path / "w.json"
    main(["--model", "tiny", "--device", "cpu", "--batches", "2", "--modes",
          "batched,batched-fast", "--steps", "1", "--repeat", "1", "--count-ops",
          "--top-ops", "3", "--json", str(out)])
    summary = json.loads(out.read_text())
    rows = summary["rows"]
    # Whole where the start-up check passes on this BLAS, tiles where it fails.
    assert rows["2 batched"]["steps"] in ("whole", "tiles 16")
    assert rows["2 batched-fast"]["steps"] == "plain"
    assert all(row["decode"] > 0 and row["decode_ops"] > 0 for row in rows.values())
    assert summary["prefill_chunk_ops"] > 0
    tops = summary["top_ops"]
    assert set(tops) == {"decode step, batch 2", "prefill chunk, 1024 tokens"}
    for found in tops.values():
        ops = found["host"]  # no device on the CPU
        assert set(found) == {"host"} and 0 < len(ops) <= 3
        assert all(name.startswith("aten::") and us > 0 for name, us in ops)
