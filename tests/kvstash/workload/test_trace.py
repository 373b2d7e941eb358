"""The trace reader, the slice fitter, the synthetic generator and the
prompt builder of bench.replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstash.workload.prompts import ALPHABET, PromptBuilder, build_prompts
from kvstash.workload.trace import (
    Trace,
    TraceError,
    TraceRequest,
    fit,
    jittered,
    jittered_runs,
    read_trace,
    synthetic,
    write_trace,
)


def line(stamp: float = 0, inputs: int = 600, outputs: int = 10,
         ids: list[int] | None = None) -> str:
    return json.dumps({"timestamp": stamp, "input_length": inputs, "output_length": outputs,
                       "hash_ids": [0, 1] if ids is None else ids})


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_reads_a_slice_with_arrivals_from_its_first_request(tmp_path: Path) -> None:
    path = write(tmp_path, line(0), "", line(1000), line(2500, 700, 5, [0, 2]), line(4000))
    trace = read_trace(path, start=1, count=2)
    assert [r.arrival_s for r in trace.requests] == [0.0, 1.5]
    assert trace.requests[1] == TraceRequest(1.5, 700, 5, (0, 2))
    assert trace.duration_s == 1.5 and trace.rate == pytest.approx(1 / 1.5)
    assert len(read_trace(path).requests) == 4


@pytest.mark.parametrize(("bad", "says"), [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected an object"),
    (json.dumps({"timestamp": 0, "input_length": 5}), "missing output_length, hash_ids"),
    (line(-1), "timestamp"),
    (line(0, 0), "input_length must be an integer > 0"),
    (line(0, 600, True), "output_length must be an integer > 0"),  # type: ignore[arg-type]
    (line(0, 600, 10, [0, -3]), "hash_ids"),
    (line(0, 1025, 10, [0, 1]), "2 hash_ids cover 1024 tokens, fewer than input_length 1025"),
])
def test_a_bad_line_is_refused_naming_it(tmp_path: Path, bad: str, says: str) -> None:
    path = write(tmp_path, line(0), bad)
    with pytest.raises(TraceError, match=rf"t\.jsonl:2: .*{says}"):
        read_trace(path)


def test_timestamps_going_back_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="timestamps go back"):
        read_trace(write(tmp_path, line(500), line(100)))


def test_a_trace_with_no_requests_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no requests"):
        read_trace(write(tmp_path, "", "  "))
    with pytest.raises(TraceError, match="no requests from #5"):
        read_trace(write(tmp_path, line(0)), start=5)
    with pytest.raises(TraceError, match="no requests"):
        Trace(())


def test_fit_scales_lengths_with_the_block_and_gaps_by_the_time_scale() -> None:
    trace = Trace((TraceRequest(0.0, 1000, 100, (0, 1)), TraceRequest(2.0, 30, 3, (0,))))
    scaled, dropped = fit(trace, length_scale=0.25, time_scale=3.0)
    assert dropped == 0 and scaled.block_tokens == 128
    assert scaled.requests == (TraceRequest(0.0, 250, 25, (0, 1)),
                               TraceRequest(6.0, 8, 1, (0,)))  # rounded, at least 1
    # Scaled lengths round: 515 tokens in 2 ids of 512 become 64 in blocks
    # of 64, which the first id covers; the unused id goes.
    trimmed, _ = fit(Trace((TraceRequest(0.0, 520, 1, (0, 1)),)), length_scale=0.125)
    assert trimmed.requests[0].hash_ids == (0, 1)
    trimmed, _ = fit(Trace((TraceRequest(0.0, 515, 1, (0, 1)),)), length_scale=0.125)
    assert trimmed.requests[0].input_length == 64 and trimmed.requests[0].hash_ids == (0,)
    longer, _ = fit(trace, length_scale=0.25, output_scale=0.5)
    assert [(r.input_length, r.output_length) for r in longer.requests] == [(250, 50), (8, 2)]


def test_fit_to_a_rate_keeps_the_pattern() -> None:
    trace = Trace(tuple(TraceRequest(t, 10, 1, (0,)) for t in (0.0, 1.0, 4.0)))
    scaled, _ = fit(trace, rate=2.0)
    assert scaled.rate == pytest.approx(2.0)
    assert [r.arrival_s for r in scaled.requests] == pytest.approx([0.0, 0.25, 1.0])
    with pytest.raises(ValueError, match="at once"):
        fit(Trace((TraceRequest(0.0, 10, 1, (0,)),) * 2), rate=1.0)
    with pytest.raises(ValueError, match="> 0"):
        fit(trace, length_scale=0)


def test_fit_drops_what_exceeds_the_context() -> None:
    trace = Trace((TraceRequest(0.0, 900, 100, (0, 1)), TraceRequest(1.0, 901, 100, (0, 1))))
    scaled, dropped = fit(trace, max_context=1000)
    assert dropped == 1 and [r.input_length for r in scaled.requests] == [900]
    with pytest.raises(TraceError, match="no request fits"):
        fit(trace, max_context=10)


def test_synthetic_is_seeded_and_shares_its_system_prompt() -> None:
    a = synthetic(200, rate=4.0, input_mean=300, output_mean=20, shared_blocks=2, seed=7,
                  block_tokens=64)
    assert a == synthetic(200, 4.0, 300, 20, 2, 7, 64)
    assert a != synthetic(200, 4.0, 300, 20, 2, 8, 64)
    assert all(r.hash_ids[:2] == (0, 1) for r in a.requests)
    own = [i for r in a.requests for i in r.hash_ids[2:]]
    assert len(own) == len(set(own))  # the rest is each request's own
    assert all(r.input_length > 128 for r in a.requests)
    assert a.rate == pytest.approx(4.0, rel=0.2)


def test_prompts_share_exactly_the_blocks_their_ids_share() -> None:
    trace = Trace((TraceRequest(0.0, 20, 1, (5, 6, 7)), TraceRequest(0.0, 18, 1, (5, 6, 9)),
                   TraceRequest(0.0, 7, 1, (5,))), block_tokens=8)
    a, b, c = build_prompts(trace, seed=3)
    assert (len(a), len(b), len(c)) == (20, 18, 7)
    assert a[:16] == b[:16] and a[16:18] != b[16:18]
    assert c == a[:7]
    assert set(a) <= set(ALPHABET)
    assert build_prompts(trace, seed=3) == [a, b, c]
    assert build_prompts(trace, seed=4)[0] != a


def test_a_block_is_the_same_in_every_process() -> None:
    # Drawn from a SHA-512 of "seed:id", not from hash(): PYTHONHASHSEED
    # and the process do not change it, so runs on two machines compare.
    assert PromptBuilder(6, seed=0).block(42) == [82, 121, 91, 36, 32, 65]


def test_a_prompt_needs_its_blocks() -> None:
    with pytest.raises(ValueError, match="need 3 blocks of 8"):
        PromptBuilder(8).prompt(TraceRequest(0.0, 17, 1, (1, 2)))


def test_a_fitted_trace_written_reads_back(tmp_path: Path) -> None:
    trace = synthetic(20, rate=3.0, input_mean=40, output_mean=5, shared_blocks=1,
                      block_tokens=32)
    write_trace(trace, tmp_path / "w.jsonl")
    again = read_trace(tmp_path / "w.jsonl")
    assert [(r.input_length, r.output_length, r.hash_ids) for r in again.requests] == \
        [(r.input_length, r.output_length, r.hash_ids) for r in trace.requests]
    assert [r.arrival_s for r in again.requests] == pytest.approx(
        [r.arrival_s for r in trace.requests], abs=1e-6)


def test_fit_to_a_rate_is_the_rate_of_what_is_kept() -> None:
    # The first request is too long: the three kept still arrive at 2/s on
    # average, from the first of them (no idle start where it was).
    trace = Trace((TraceRequest(0.0, 2000, 1, (0, 1, 2, 3)),
                   *(TraceRequest(t, 10, 1, (0,)) for t in (1.0, 2.0, 5.0))))
    scaled, dropped = fit(trace, rate=2.0, max_context=100)
    assert dropped == 1 and scaled.rate == pytest.approx(2.0)
    assert [r.arrival_s for r in scaled.requests] == pytest.approx([0.0, 0.25, 1.0])
    shifted, _ = fit(trace, time_scale=2.0, max_context=100)
    assert [r.arrival_s for r in shifted.requests] == pytest.approx([0.0, 2.0, 8.0])
    with pytest.raises(ValueError, match="at once"):
        fit(Trace((TraceRequest(0.0, 10, 1, (0,)), TraceRequest(1.0, 2000, 1, (0, 1, 2, 3)))),
            rate=1.0, max_context=100)


def test_jitter_delays_each_arrival_a_little_and_reorders_a_burst() -> None:
    burst = Trace(tuple(TraceRequest(t, 100 + i, 5, (i,))
                        for i, t in enumerate([0.0, 0.0, 0.0, 0.0, 0.5, 0.5])))
    a = jittered(burst, 0.002, seed=3)
    assert a == jittered(burst, 0.002, seed=3)  # seeded
    assert a != jittered(burst, 0.002, seed=4)
    assert jittered(burst, 0.0, seed=3) == burst
    arrivals = [r.arrival_s for r in a.requests]
    assert arrivals == sorted(arrivals)  # in arrival order, as a trace is
    original = {r.input_length: r.arrival_s for r in burst.requests}
    lags = [r.arrival_s - original[r.input_length] for r in a.requests]
    assert all(0.0 <= lag <= 0.002 for lag in lags) and max(lags) > 0
    assert sorted(r.hash_ids for r in a.requests) == [r.hash_ids for r in burst.requests]
    orders = {tuple(r.input_length for r in jittered(burst, 0.002, seed).requests[:4])
              for seed in range(20)}
    assert len(orders) > 1  # the requests a burst sends at once come in any order
    assert jittered_runs(burst, 3, 0.002) == [burst, jittered(burst, 0.002, 1),
                                              jittered(burst, 0.002, 2)]
    with pytest.raises(ValueError, match="jitter"):
        jittered(burst, -0.001, seed=0)


@pytest.mark.parametrize("scales", [
    {"time_scale": float("nan")},    # every arrival NaN: the replay sends all at once
    {"time_scale": float("inf")},    # first arrival 0 * inf = NaN, the rest inf
    {"length_scale": float("inf")},  # OverflowError from round(), not a ValueError
    {"output_scale": float("inf")},
    {"rate": float("inf")},
])
def test_fit_refuses_a_scale_that_is_not_finite(scales: dict[str, float]) -> None:
    trace = Trace((TraceRequest(0.0, 600, 10, (0, 1)), TraceRequest(1.0, 600, 10, (0, 1))))
    with pytest.raises(ValueError, match="must be finite and > 0"):
        fit(trace, **scales)  # type: ignore[arg-type]


def test_a_timestamp_too_large_for_a_float_is_refused_naming_the_line(tmp_path: Path) -> None:
    """A JSON integer past any float: refused by line, not an OverflowError."""
    huge = '{"timestamp": 1' + "0" * 400 + ', "input_length": 600, "output_length": 10, ' \
        '"hash_ids": [0, 1]}'
    with pytest.raises(TraceError, match=r"t\.jsonl:2: .*timestamp"):
        read_trace(write(tmp_path, line(0), huge))


def test_timestamps_going_back_name_the_line(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"t\.jsonl:3"):
        read_trace(write(tmp_path, line(0), line(500), line(100)))


def test_a_fitted_slice_written_reads_back_as_it_was_with_its_block(tmp_path: Path) -> None:
    """--write-trace writes a slice as fitted (hash ids of 32 tokens at x1/16,
    1,024 at x2); read back with that block (--block-tokens) it is the same
    slice, the same prompts; read with Mooncake's 512 it is refused or would
    share what it must not."""
    raw = Trace((TraceRequest(0.0, 1400, 10, (0, 1, 2)), TraceRequest(1.0, 1400, 10, (0, 3, 4))))
    for scale in (0.0625, 2.0):
        fitted, _ = fit(raw, length_scale=scale)
        write_trace(fitted, tmp_path / "w.jsonl")
        again = read_trace(tmp_path / "w.jsonl", block_tokens=fitted.block_tokens)
        assert again == fitted and build_prompts(again) == build_prompts(fitted)
    small, _ = fit(raw, length_scale=0.0625)
    a, b = build_prompts(small)
    assert a[:32] == b[:32] and a[32:] != b[32:]  # only their first id is shared
    with pytest.raises(TraceError, match=r"w\.jsonl:1: 3 hash_ids cover 1536 tokens"):
        read_trace(tmp_path / "w.jsonl")  # the x2 slice, at 512 tokens an id
    with pytest.raises(ValueError, match="block_tokens > 0"):
        read_trace(tmp_path / "w.jsonl", block_tokens=0)


def test_a_line_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    """By file and line, like any other bad line, not by its position in the
    decoder's buffer."""
    path = tmp_path / "t.jsonl"
    path.write_bytes(f"{line(0)}\n{line(1)}\n".encode() + line(2).encode()[:-1] + b"\xff}\n")
    with pytest.raises(TraceError, match=r"t\.jsonl:3: not UTF-8 \(byte 0xff at column"):
        read_trace(path)
