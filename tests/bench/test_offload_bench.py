"""The offload benchmark is a preset of the trace replayer: its flags must
still parse there, and a flag given after them must win."""

from bench.offload_bench import PRESET
from bench.replay.__main__ import parse_args


def test_preset_parses_as_replay_flags() -> None:
    args = parse_args(list(PRESET))
    assert args.synthetic == 48 and args.num_blocks == 96 and args.rates == [50.0]
    assert args.policies == ["recompute", "offload", "auto", "recompute-fixed", "offload-fixed"]


def test_later_flags_override_the_preset() -> None:
    args = parse_args([*PRESET, "--num-blocks", "128", "--model", "llama-small"])
    assert args.num_blocks == 128 and args.model == "llama-small"
