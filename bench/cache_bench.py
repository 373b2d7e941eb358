"""Cache throughput over loopback against a raw TCP socket moving the same bytes.

    python -m bench.cache_bench [--size 256MiB]

Starts `python -m cache_svc` as a separate process, puts and gets one
snapshot per chunk size (1, 2, 4 MiB) through CacheClient, and compares with
a plain socket server process that receives and sends the same number of
bytes. Prints a table, the ratios, and the server's peak resident memory.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvstash.cache_client import CacheClient
from kvstash.rpc import MIB, parse_bytes
from kvstash.v1 import common_pb2

REPO = Path(__file__).resolve().parent.parent
_IO_BYTES = 4 * MIB


def _raw_server(listener: socket.socket) -> None:
    """Per connection: 'P' + length -> receive and ack; 'G' + length -> send."""
    buffer = bytearray(_IO_BYTES)
    payload = bytes(_IO_BYTES)
    while True:
        conn, _ = listener.accept()
        with conn:
            op, length = struct.unpack("<cQ", _recv_exact(conn, 9))
            if op == b"P":
                left = length
                view = memoryview(buffer)
                while left:
                    left -= conn.recv_into(view[: min(left, _IO_BYTES)])
                conn.sendall(b"k")
            else:
                left = length
                while left:
                    n = min(left, _IO_BYTES)
                    conn.sendall(payload[:n])
                    left -= n


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        data += conn.recv(n - len(data))
    return data


def raw_socket_round(port: int, data: memoryview) -> tuple[float, float]:
    """Seconds to send `data` to the raw server and to receive as many bytes."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        started = time.perf_counter()
        conn.sendall(struct.pack("<cQ", b"P", data.nbytes))
        for start in range(0, data.nbytes, _IO_BYTES):
            conn.sendall(data[start : start + _IO_BYTES])
        _recv_exact(conn, 1)
        put_s = time.perf_counter() - started
    out = bytearray(data.nbytes)
    view = memoryview(out)
    with socket.create_connection(("127.0.0.1", port)) as conn:
        started = time.perf_counter()
        conn.sendall(struct.pack("<cQ", b"G", data.nbytes))
        got = 0
        while got < data.nbytes:
            got += conn.recv_into(view[got : got + _IO_BYTES])
        get_s = time.perf_counter() - started
    return put_s, get_s


def start_cache(memory_budget: int) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "cache_svc", "--listen", "127.0.0.1:0",
         "--memory-budget", str(memory_budget), "--log-level", "warning"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("KVSTASH_READY cache "):
            return proc, line.split()[2]
    raise RuntimeError(f"cache server exited with {proc.wait()}")


def vm_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


async def cache_round(address: str, data: np.ndarray, chunk_bytes: int) -> tuple[float, float]:
    layout = common_pb2.KvLayout(num_layers=1, block_size=1, num_kv_heads=1,
                                 head_dim=MIB // 4, dtype="float16")  # 1 MiB blocks
    num_blocks = data.nbytes // MIB
    out = np.empty_like(data)
    name = f"bench-{chunk_bytes}"
    async with CacheClient(address, chunk_bytes=chunk_bytes, timeout_s=600) as client:
        started = time.perf_counter()
        await client.put(name, layout, num_blocks, num_blocks, data)
        put_s = time.perf_counter() - started
        started = time.perf_counter()
        await client.get_into(name, out.data)
        get_s = time.perf_counter() - started
        await client.delete(name)
    if not np.array_equal(out, data):
        raise AssertionError("snapshot came back different")
    return put_s, get_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cache_bench")
    parser.add_argument("--size", type=parse_bytes, default=256 * MIB)
    args = parser.parse_args(argv)
    size = args.size // MIB * MIB
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)

    listener = socket.create_server(("127.0.0.1", 0))
    raw = multiprocessing.get_context("fork").Process(target=_raw_server, args=(listener,),
                                                      daemon=True)
    raw.start()
    raw_put, raw_get = raw_socket_round(listener.getsockname()[1], memoryview(data))
    raw.kill()

    proc, address = start_cache(memory_budget=size + 64 * MIB)
    baseline_kib = vm_kib(proc.pid, "VmRSS")
    rows = []
    try:
        for chunk_mib in (1, 2, 4):
            put_s, get_s = asyncio.run(cache_round(address, data, chunk_mib * MIB))
            rows.append((chunk_mib, put_s, get_s))
        peak_kib = vm_kib(proc.pid, "VmHWM")
    finally:
        proc.terminate()
        proc.wait(30)

    mib = size / MIB
    print(f"snapshot {mib:.0f} MiB over loopback, {os.cpu_count()} CPUs")
    print(f"{'path':<22}{'put MiB/s':>11}{'get MiB/s':>11}{'put ratio':>11}{'get ratio':>11}")
    print(f"{'raw TCP socket':<22}{mib / raw_put:>11.0f}{mib / raw_get:>11.0f}{1:>11.2f}{1:>11.2f}")
    for chunk_mib, put_s, get_s in rows:
        print(f"{f'cache, {chunk_mib} MiB chunks':<22}{mib / put_s:>11.0f}{mib / get_s:>11.0f}"
              f"{raw_put / put_s:>11.2f}{raw_get / get_s:>11.2f}")
    best = min(rows, key=lambda r: r[1] + r[2])
    print(f"best chunk size: {best[0]} MiB (lowest put+get time)")
    print(f"cache server RSS: idle {baseline_kib / 1024:.0f} MiB, peak {peak_kib / 1024:.0f} MiB "
          f"(memory budget {(size + 64 * MIB) / MIB:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
