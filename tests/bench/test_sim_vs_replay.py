"""bench.sim_vs_replay end to end on the tiny model: a real P/D stack (a
prefill and a decode instance, real processes) beside its simulation, every
figure in the table, the hand-offs counted on both sides, the real steps
timed against the profile from the prefill scheduler's own record."""

from __future__ import annotations

import pytest

from bench.sim_vs_replay import FIGURES, main


def test_a_pd_slice_is_replayed_and_simulated_side_by_side(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--synthetic", "6", "--rates", "2", "--synthetic-input", "64",
                 "--synthetic-output", "8", "--model", "tiny", "--policies", "offload",
                 "--num-blocks", "256", "--pd"]) == 0
    rows = {" ".join(line.split()[2:-4]): line.split()[-4:]
            for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == set(FIGURES)
    real, _, sim, _ = rows["hand-offs"]
    assert float(real) == float(sim) == 6  # every request decoded on the decode instance
    real, _, sim, _ = rows["step s/profile"]
    # The tiny model's steps against the llama-small profile: far quicker.
    assert 0 < float(real) < 1 and float(sim) == 1
