"""Who may use the arena (cache_svc.arena, kvstash.cache_sdk.shared_arena):
other local users can neither stop the cache by leaving files in its
directory nor hand the worker a file of theirs to fill with KV. Setting up
other users' files needs root; those tests skip otherwise."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cache_svc.arena import ALIGN, Arena, remove_stale
from kvstash.cache_sdk.shared_arena import SharedArena, arena_file_name
from kvstash.v1 import cache_pb2

OTHER_UID = 65534  # nobody: another local user
CACHE_UID = 65533  # the user the cache runs as

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="sets up other users' files")


def run_as(uid: int, action: Callable[[], object]) -> int:
    """Runs `action` in a forked child as user and group `uid`; its exit
    code: 0 when it returned, 1 when it raised (printed)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            action()
            os._exit(0)
        except BaseException as exc:  # reported by the exit code
            print(f"as uid {uid}: {exc!r}", file=sys.stderr, flush=True)
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.fixture
def shm() -> Iterator[Path]:
    """A directory like /dev/shm: root's, anyone may write, sticky (pytest's
    tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(dir="/tmp"))
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@needs_root
def test_another_users_arena_named_file_does_not_stop_the_cache(
        shm: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The sticky bit keeps the cache from removing it: unlink would fail."""
    planted = shm / arena_file_name("0000000000000000")
    assert run_as(OTHER_UID, lambda: planted.write_bytes(b"")) == 0
    assert run_as(CACHE_UID, lambda: Arena(shm, 16 * ALIGN).close()) == 0
    with caplog.at_level(logging.INFO, logger="cache_svc.arena"):
        assert remove_stale(shm) == 0  # root could remove it, and leaves it too
    assert planted.exists()
    assert f"left {planted} alone: not a file of this user (uid {OTHER_UID}" in caplog.text


@needs_root
def test_the_cache_refuses_an_arena_directory_another_user_owns(shm: Path) -> None:
    """Its owner could rename the arena away and put a file of their own in
    its place, sticky bit or not; root's directories (/dev/shm, a Kubernetes
    emptyDir) and the cache's own are fine."""
    theirs = shm / "kvstash"
    assert run_as(OTHER_UID, theirs.mkdir) == 0
    for mode in (0o755, 0o1777):
        os.chmod(theirs, mode)
        with pytest.raises(PermissionError, match=f"arena directory {theirs} belongs to uid "
                                                  f"{OTHER_UID}"):
            Arena(theirs, 16 * ALIGN)
        assert not list(theirs.iterdir())
    os.chmod(shm, 0o777)  # root's, not sticky: as an emptyDir is
    assert run_as(CACHE_UID, lambda: Arena(shm, 16 * ALIGN).close()) == 0
    assert run_as(CACHE_UID, lambda: Arena(shm / "own", 16 * ALIGN).close()) == 0


def test_the_worker_maps_only_a_0600_arena_file_of_its_own_user(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whoever controls the directory could swap the cache's arena for a
    file of the same name and size: the worker would write every offloaded
    block into it. Root maps a cache's arena whoever it runs as."""
    arena = Arena(tmp_path, 16 * ALIGN)
    info = cache_pb2.ArenaInfo(path=str(arena.path), size_bytes=arena.size,
                               arena_id=arena.arena_id)
    SharedArena(info).close()
    os.chmod(arena.path, 0o640)
    with pytest.raises(ValueError, match=r"is not a cache arena file: -rw-r-----"):
        SharedArena(info)
    os.chmod(arena.path, 0o600)
    if os.geteuid() == 0:
        os.chown(arena.path, OTHER_UID, OTHER_UID)
        SharedArena(info).close()
    owner = os.stat(arena.path).st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)  # as another user would see it
    with pytest.raises(ValueError, match=f"uid {owner} .*of this process's uid {owner + 1}"):
        SharedArena(info)
    arena.close()
