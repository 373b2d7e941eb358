"""`kvstash sim` and `kvstash calibrate` as users run them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstash.sim.__main__ import main
from kvstash.sim.profile import read_profile
from tests.gpu_worker.worker_factories import REPO
from tests.kvstash.sim.test_profile import GOOD
from tests.process_helpers import child_pids, cmdline_of, descendant_pids, is_running

SMALL = ["--synthetic", "30", "--rates", "6", "--synthetic-input", "128",
         "--synthetic-output", "48", "--num-blocks", "64", "--max-num-seqs", "16"]


def test_sim_prints_a_row_per_policy_and_writes_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    assert main(["sim", *SMALL, "--policies", "recompute,offload", "--json", str(out)]) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert "recompute" in rows and "offload" in rows
    runs = json.loads(out.read_text())["runs"]
    assert [r["policy"] for r in runs] == ["recompute", "offload"]
    assert all(r["summary"]["num_completed"] == 30 for r in runs)
    assert runs[1]["counters"]["num_recomputed_tokens"] == 0


def test_sim_json_is_strict_a_figure_without_a_value_is_null(tmp_path: Path) -> None:
    """One-token outputs have no TPOT: its percentiles are null, not NaN
    (which jq and every strict JSON reader refuse)."""
    trace, out = tmp_path / "trace.jsonl", tmp_path / "sim.json"
    trace.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 64,
                                         "output_length": 1, "hash_ids": [i]}) + "\n"
                             for i in range(6)))
    assert main(["sim", "--trace", str(trace), "--policies", "recompute",
                 "--json", str(out)]) == 0

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} in {out.name}")

    [run] = json.loads(out.read_text(), parse_constant=refuse)["runs"]
    assert run["summary"]["num_completed"] == 6
    assert run["summary"]["tpot_s"]["p50"] is None


def test_sim_refuses_a_bad_profile_naming_the_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({**GOOD, "block_size": -4}))
    assert main(["sim", *SMALL, "--profile", str(bad)]) == 2
    assert "block_size: a positive integer is needed" in capsys.readouterr().err


@pytest.mark.parametrize("find", [[], ["--find", "instances"]])
def test_sim_refuses_a_slice_nothing_of_which_fits_before_any_run(
        find: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", *SMALL, "--max-context", "64", *find]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("kvstash sim: ") and "SLO attainment" not in captured.out


def test_sim_says_how_many_requests_it_dropped_as_too_long(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Its rows count only the requests simulated: those --max-context cut
    are said, not hidden in a full row (found in review, 2026-11-28)."""
    assert main(["sim", *SMALL, "--policies", "recompute", "--max-context", "680"]) == 0
    out = capsys.readouterr().out
    dropped = re.search(r"(\d+) requests longer than the context limit dropped", out)
    assert dropped is not None, out
    assert 0 < int(dropped[1]) < 30


def test_sim_drops_by_default_what_the_pool_cannot_hold(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A core refuses a request longer than its pool (42 blocks of 16: 672
    tokens), so by default the slice drops it rather than simulating its
    failure; a --max-context beyond the pool is refused."""
    out = tmp_path / "sim.json"
    assert main(["sim", *SMALL, "--num-blocks", "42", "--policies", "recompute",
                 "--json", str(out)]) == 0
    run, = json.loads(out.read_text())["runs"]
    assert run["dropped"] > 0
    assert run["summary"]["num_completed"] == run["summary"]["num_requests"] == 30 - run["dropped"]
    assert main(["sim", *SMALL, "--num-blocks", "42", "--max-context", "673"]) == 2
    assert "--max-context 673 is more than an instance serves: 672 tokens" in \
        capsys.readouterr().err


def test_sim_refuses_an_unknown_policy() -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["sim", *SMALL, "--policies", "offload,telepathy"])
    assert exit_info.value.code == 2


def test_sim_whose_reader_goes_away_ends_quietly() -> None:
    """`kvstash sim ... | head -3`: the reader's end of the pipe closes
    before the table is written; sim ends with status 1 and says nothing (it
    said `[Errno 32] Broken pipe` and exited 2)."""
    done = subprocess.Popen(
        [sys.executable, "-m", "kvstash.launch.cli", "sim", *SMALL, "--policies", "recompute"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert done.stdout is not None
    done.stdout.close()  # the reader goes away
    _, err = done.communicate(timeout=120)
    assert (done.returncode, err) == (1, "")


def test_calibrate_measures_a_profile_the_sim_reads(tmp_path: Path) -> None:
    """A real cache and worker (the tiny model), driven and fitted, at the
    prefill chunk sizes asked for."""
    out = tmp_path / "tiny.json"
    done = subprocess.run([sys.executable, "-m", "kvstash.launch.cli", "calibrate", str(out),
                           "--model", "tiny", "--repeat", "1", "--prefill-chunks", "48,96"],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    table = done.stdout.split("fitted ms\n", 1)[1].split("{", 1)[0].split("\n")
    prefills = {float(line.split()[2]) for line in table if line.strip()}
    assert {48.0, 96.0} <= prefills and 256.0 not in prefills
    profile = read_profile(out)
    assert profile.step.fixed_s + profile.step.decode_row_s > 0
    assert profile.bytes_per_block == 4 * 2 * 16 * 2 * 32 * 8  # tiny, float64
    assert all("kvstash calibrate --model tiny" in text for text in profile.source.values())
    assert "--prefill-chunks 48,96" in profile.source["step"]


def test_calibrate_whose_reader_goes_away_still_writes_its_profile(tmp_path: Path) -> None:
    """`kvstash calibrate p.json | head`: the reader's end of the pipe closes
    before the table is printed; the measured profile is written regardless
    (printed first, it was lost), and calibrate ends quietly with status 1."""
    out = tmp_path / "tiny.json"
    done = subprocess.Popen(
        [sys.executable, "-m", "kvstash.launch.cli", "calibrate", str(out), "--model", "tiny",
         "--repeat", "1", "--prefill-chunks", "48"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert done.stdout is not None
    done.stdout.close()  # the reader goes away
    _, err = done.communicate(timeout=300)
    assert (done.returncode, err) == (1, "")
    assert read_profile(out).step.fixed_s + read_profile(out).step.decode_row_s > 0


def test_find_prints_the_curve_and_the_least_instances(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Real simulations: at 6 requests/s one instance misses the SLOs, enough meet them."""
    assert main(["sim", *SMALL, "--policies", "auto", "--find", "instances",
                 "--target", "0.9", "--plots", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    curve = {int(line.split()[1].rstrip(":").replace(",", "")):
             float(line.split()[4].rstrip("%,"))
             for line in out.splitlines() if line.startswith("  instances")}
    least = int(out.splitlines()[-1].split()[-1].replace(",", ""))
    assert curve[least] >= 90 and curve[1] < 90
    assert all(attained < 90 for n, attained in curve.items() if n < least)
    assert (tmp_path / "find.png").read_bytes()[:4] == b"\x89PNG"


def test_sim_plots(tmp_path: Path) -> None:
    assert main(["sim", *SMALL[:2], "--rates", "3,6", *SMALL[4:], "--policies",
                 "recompute,offload", "--plots", str(tmp_path)]) == 0
    for name in ("latency_cdf.png", "occupancy.png", "goodput.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_sim_runs_pd_pools_and_reports_their_hand_offs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pd.json"
    assert main(["sim", *SMALL, "--policies", "offload", "--prefill-instances", "1",
                 "--decode-instances", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    run = json.loads(out.read_text())["runs"][0]
    c = run["counters"]
    assert run["summary"]["num_completed"] == 30 and c["num_handoffs"] > 0
    assert (f"P/D: {c['num_handoffs']} handed off ({c['num_handoff_failures']} finished on "
            f"a prefill instance); reservations {c['num_reservations_accepted']} accepted, "
            f"{c['num_reservations_refused']} refused") in printed


@pytest.mark.parametrize("flags, error", [
    (["--prefill-instances", "2"], "needs both --prefill-instances and --decode-instances"),
    (["--prefill-instances", "1", "--decode-instances", "1", "--instances", "3"],
     "give it or P/D pools, not both"),
    (["--prefill-instances", "1", "--decode-instances", "1", "--find", "instances"],
     "--find sizes mixed instances"),
    (["--handoff-wait", "-1"], "--handoff-wait must be a finite number of seconds >= 0"),
    (["--handoff-wait", "nan"], "--handoff-wait must be a finite number of seconds >= 0"),
    (["--handoff-wait", "inf"], "--handoff-wait must be a finite number of seconds >= 0"),
    (["--count", "5"], "--start and --count cut a --trace"),
    (["--start", "3"], "--start and --count cut a --trace"),
    (["--target", "0.5"], "--target: the SLO attainment in (0, 1] --find sizes for"),
    (["--find", "instances", "--target", "1.5"], "--target: the SLO attainment in (0, 1]"),
])
def test_sim_refuses_pd_flags_that_do_not_fit(
        flags: list[str], error: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["sim", *SMALL, *flags])
    assert exit_info.value.code == 2
    assert error in capsys.readouterr().err


def test_sim_runs_jittered_copies_and_shows_their_spread(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--runs: the trace as it is, then copies with arrivals up to --jitter
    late; the row is the exact run's, the spread line and the JSON add the rest."""
    exact, jittered = tmp_path / "exact.json", tmp_path / "jittered.json"
    assert main(["sim", *SMALL, "--policies", "recompute", "--json", str(exact)]) == 0
    capsys.readouterr()
    assert main(["sim", *SMALL, "--policies", "recompute", "--runs", "5", "--jitter", "0.01",
                 "--json", str(jittered)]) == 0
    spread_line = next(line for line in capsys.readouterr().out.splitlines()
                       if "runs, median (min-max):" in line)
    assert spread_line.split()[0] == "5"
    plain, = json.loads(exact.read_text())["runs"]
    run, = json.loads(jittered.read_text())["runs"]
    assert run["summary"] == plain["summary"] and plain["jittered"] == []
    assert len(run["jittered"]) == 4
    p50s = [s["ttft_s"]["p50"] for s in [run["summary"], *run["jittered"]]]
    assert len(set(p50s)) > 1  # a few ms moved the schedule
    found = re.search(r"TTFT p50 ([\d.]+) \(([\d.]+)-([\d.]+)\)", spread_line)
    assert found is not None, spread_line
    median, low, high = map(float, found.groups())
    assert (low, high) == (round(min(p50s), 3), round(max(p50s), 3))
    assert low <= median <= high


@pytest.mark.parametrize("bad", [["--runs", "0"], ["--jitter", "-0.001"],
                                 ["--jitter", "nan"]])
def test_sim_refuses_bad_runs_or_jitter(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["sim", *SMALL, *bad])
    assert exit_info.value.code == 2


def test_find_num_blocks_from_a_pool_too_small_for_any_request_searches_on(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Pools of 1, 2 and 4 blocks serve none of these prompts (33+ blocks):
    three runs alike, and --find gave up at 4 blocks, "more stopped
    helping", where 141 meet the target."""
    assert main(["sim", *SMALL, "--policies", "auto", "--find", "num-blocks",
                 "--num-blocks", "1", "--target", "0.9"]) == 0
    out = capsys.readouterr().out
    assert "  num-blocks              4: SLO attainment   0.0%" in out
    least = int(out.splitlines()[-1].split()[-1].replace(",", ""))
    assert out.splitlines()[-1].startswith("least num-blocks") and least > 64


def test_find_with_runs_uses_the_median_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", *SMALL, "--policies", "auto", "--find", "instances", "--runs", "3",
                 "--target", "0.9"]) == 0
    out = capsys.readouterr().out
    assert "(the median of 3 runs)" in out and out.splitlines()[-1].startswith("least instances")


@pytest.mark.parametrize("flag, path, says", [
    ("--json", "missing/sim.json", "no directory"),
    ("--json", ".", "is a directory"),
    ("--plots", "a-file", "not a directory"),
    ("--plots", "a-file/plots", "not a directory"),
    # A directory no file can be made in: found once the runs were done.
    ("--json", "/proc/sim.json", "cannot write in /proc"),
    ("--plots", "/proc", "cannot write in it"),
])
def test_an_output_that_cannot_be_written_is_refused_before_any_run(
        tmp_path: Path, flag: str, path: str, says: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Found after the runs, it was a traceback at the end of them, the JSON
    or plots lost."""
    (tmp_path / "a-file").write_text("")
    assert main(["sim", *SMALL, "--policies", "recompute", flag, str(tmp_path / path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"kvstash sim: {flag} ") and says in captured.err
    assert "policy" not in captured.out  # no run began


def test_calibrate_refuses_an_output_it_could_not_write_before_it_measures(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It measured for minutes, then failed writing with a traceback; here the
    model does not exist, so a calibration that began fails on its worker."""
    out = tmp_path / "missing" / "p.json"
    assert main(["calibrate", str(out), "--model", str(tmp_path / "no-model")]) == 2
    assert f"no directory {out.parent}" in capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
def test_calibrate_ended_by_a_signal_leaves_no_service_running(
        tmp_path: Path, sig: signal.Signals) -> None:
    """Killed by SIGTERM (a service manager, `timeout`) or SIGHUP, calibrate
    left its cache and worker running, orphaned; it stops them as on Ctrl-C.
    SIGKILL (the OOM killer, a CI runner's timeout) runs no handler of its:
    its cache and worker are sent SIGTERM as it dies, and stop."""
    calibrate = subprocess.Popen(
        [sys.executable, "-m", "kvstash.sim", "calibrate", str(tmp_path / "p.json"),
         "--repeat", "1"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(children := child_pids(calibrate.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(children) == 2, children  # the cache, and the worker starting or up
        calibrate.send_signal(sig)
        status = calibrate.wait(60)
        deadline = time.monotonic() + 60
        while any(map(is_running, children)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if is_running(pid)]
        if sig is not signal.SIGKILL:
            assert status == 130
            assert calibrate.stderr is not None
            assert calibrate.stderr.read().strip().splitlines()[-1] == (
                "kvstash calibrate: stopped")
    finally:
        for pid in [calibrate.pid, *children]:
            if is_running(pid):
                os.kill(pid, signal.SIGKILL)
        calibrate.wait()


def test_a_sighup_ignored_as_under_nohup_stays_ignored() -> None:
    """`nohup kvstash calibrate ... &`, then logging out: it runs on."""
    probe = ("import signal; from kvstash.sim.__main__ import _stop_as_ctrl_c; "
             "_stop_as_ctrl_c(); print(signal.getsignal(signal.SIGHUP) is signal.SIG_IGN, "
             "signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)")

    def run(*ignored: signal.Signals) -> list[str]:
        def ignore() -> None:
            for sig in ignored:
                signal.signal(sig, signal.SIG_IGN)
        return subprocess.run([sys.executable, "-c", probe], cwd=REPO, preexec_fn=ignore,
                              capture_output=True, text=True, check=True).stdout.split()

    assert run(signal.SIGHUP) == ["True", "False"]
    assert run() == ["False", "False"]






def test_the_kvstash_command_stopped_by_sigterm_leaves_nothing_of_calibrate_running(
        tmp_path: Path) -> None:
    """`kvstash calibrate` ran `python -m kvstash.sim calibrate` as a child:
    a SIGTERM to the command killed it alone, and the calibration (its cache
    and worker with it) ran on, orphaned."""
    command = subprocess.Popen(
        [sys.executable, "-m", "kvstash.launch.cli", "calibrate", str(tmp_path / "p.json"),
         "--repeat", "500"],  # minutes: it must not end of itself meanwhile
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not any("gpu_worker" in cmdline_of(pid) for pid in started) \
                and time.monotonic() < deadline:
            started = descendant_pids(command.pid)
            time.sleep(0.05)
        assert any("gpu_worker" in cmdline_of(pid) for pid in started), started
        command.send_signal(signal.SIGTERM)
        command.wait(60)
        deadline = time.monotonic() + 30
        while any(map(is_running, started)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [cmdline_of(pid) for pid in started if is_running(pid)]
    finally:
        for pid in [command.pid, *started]:
            if is_running(pid):
                os.kill(pid, signal.SIGKILL)
        command.wait()


def test_calibrate_with_a_chunk_past_the_models_context_is_one_line(tmp_path: Path) -> None:
    """The worker refuses the step (the tiny model serves 1,024 tokens): that
    was a traceback, the services stopped."""
    done = subprocess.run([sys.executable, "-m", "kvstash.sim", "calibrate",
                           str(tmp_path / "p.json"), "--repeat", "1", "--prefill-chunks", "4096"],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2
    last, = done.stderr.strip().splitlines()
    assert last.startswith("kvstash calibrate: ") and "exceed max_model_len 1024" in last
    assert not (tmp_path / "p.json").exists()
