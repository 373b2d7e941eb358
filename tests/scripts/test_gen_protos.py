"""`make protos` is the only source of kvstash/v1; `--check` catches drift."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _copy_tree(tmp_path: Path) -> Path:
    for folder in ("scripts", "protos", "kvstash/v1"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    return tmp_path


def _check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(root / "scripts" / "gen_protos.py"), "--check"],
                          capture_output=True, text=True, timeout=120, check=False)


def test_committed_code_matches_protos(tmp_path: Path) -> None:
    result = _check(_copy_tree(tmp_path))
    assert result.returncode == 0, result.stderr


def test_hand_edit_of_generated_code_is_caught(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path)
    stub = root / "kvstash/v1/cache_pb2.pyi"
    stub.write_text(stub.read_text() + "\n# edited by hand\n")
    result = _check(root)
    assert result.returncode == 1
    assert "cache_pb2.pyi" in result.stderr


def test_changed_proto_is_caught(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path)
    proto = root / "protos/kvstash/v1/common.proto"
    proto.write_text(proto.read_text() + "\nmessage Extra {}\n")
    result = _check(root)
    assert result.returncode == 1
    assert "common_pb2" in result.stderr
