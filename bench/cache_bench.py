"""Cache throughput over loopback against a raw TCP socket moving the same bytes.

    python -m bench.cache_bench [--size 256MiB] [--rounds 5] [--compare "--buffer-pool 0"]

Starts `python -m cache_svc` and a plain socket server as separate processes.
For each chunk size (1, 2, 4 MiB), each round puts and gets one snapshot
through CacheClient and, right beside it, sends and receives the same bytes
over a raw socket with the same chunking loop; ratios are taken per round (so
machine noise hits both sides alike) and their median printed. Both gets land
in the same preallocated buffer; the raw server receives into a reused 4 MiB
buffer, the cache into a snapshot buffer (fresh in a round's first put, then
reused from the server's buffer pool unless it runs with --buffer-pool 0).
Also prints peak resident memory of the cache server and of this (client)
process.

`--compare ARGS` starts a second cache server with those extra flags (e.g.
with a feature turned off) and runs it in the same rounds, in alternating
order, against the same raw-socket times: a before/after comparison on a
shared, noisy machine.

This process calls kvstash.common.malloc_tuning.tune_malloc() like the server: any process
streaming snapshots should (see that module for why).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.common.layout import Layout
from kvstash.common.malloc_tuning import tune_malloc
from kvstash.common.units import MIB, parse_bytes

REPO = Path(__file__).resolve().parent.parent
_IO_BYTES = 4 * MIB
CHUNK_MIBS = (1, 2, 4)


def _raw_server(listener: socket.socket) -> None:
    """Per connection: 'P' + length -> receive and ack; 'G' + length + chunk -> send."""
    buffer = bytearray(_IO_BYTES)
    payload = bytes(_IO_BYTES)
    while True:
        conn, _ = listener.accept()
        with conn:
            op, length, chunk = struct.unpack("<cQQ", _recv_exact(conn, 17))
            if op == b"P":
                left = length
                view = memoryview(buffer)
                while left:
                    left -= conn.recv_into(view[: min(left, _IO_BYTES)])
                conn.sendall(b"k")
            else:
                left = length
                view = memoryview(payload)  # a bytes slice would copy each chunk first
                while left:
                    n = min(left, chunk)
                    conn.sendall(view[:n])
                    left -= n


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        data += conn.recv(n - len(data))
    return data


def raw_socket_round(
    port: int, data: memoryview, out: memoryview, chunk_bytes: int
) -> tuple[float, float]:
    """Seconds to send `data` to the raw server in `chunk_bytes` pieces, and to
    receive as many bytes into `out`."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        started = time.perf_counter()
        conn.sendall(struct.pack("<cQQ", b"P", data.nbytes, chunk_bytes))
        for start in range(0, data.nbytes, chunk_bytes):
            conn.sendall(data[start : start + chunk_bytes])
        _recv_exact(conn, 1)
        put_s = time.perf_counter() - started
    with socket.create_connection(("127.0.0.1", port)) as conn:
        started = time.perf_counter()
        conn.sendall(struct.pack("<cQQ", b"G", data.nbytes, chunk_bytes))
        got = 0
        while got < data.nbytes:
            got += conn.recv_into(out[got : got + chunk_bytes])
        get_s = time.perf_counter() - started
    return put_s, get_s


def start_cache(
    memory_budget: int, extra_args: list[str]
) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "cache_svc", "--listen", "127.0.0.1:0",
         "--memory-budget", str(memory_budget), "--log-level", "warning", *extra_args],
        cwd=REPO, env={**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))},
        stdout=subprocess.PIPE, text=True,
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


async def cache_round(
    client: CacheClient, name: str, data: np.ndarray, out: np.ndarray
) -> tuple[float, float]:
    layout = Layout(num_layers=1, block_size=1, num_kv_heads=1, head_dim=MIB // 4,
                    dtype="float16")  # 1 MiB blocks
    num_blocks = data.nbytes // MIB
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


Times = list[tuple[float, float, float, float]]  # (raw put, raw get, put, get) s per round


async def run_rounds(
    addresses: list[str], raw_port: int, data: np.ndarray, rounds: int
) -> list[tuple[int, list[Times]]]:
    """Per chunk size, per cache server: its times and the raw times of each round."""
    out = np.zeros_like(data)  # both paths' get destination, faulted in once
    results = []
    for chunk_mib in CHUNK_MIBS:
        chunk_bytes = chunk_mib * MIB
        clients = [CacheClient(a, chunk_bytes=chunk_bytes, timeout_s=600) for a in addresses]
        times: list[Times] = [[] for _ in addresses]
        try:
            for i in range(rounds):
                raw_put, raw_get = raw_socket_round(raw_port, data.data, out.data,
                                                    chunk_bytes)
                # Alternate which server goes first, so neither always follows the raw run.
                order = range(len(clients)) if i % 2 == 0 else reversed(range(len(clients)))
                for k in order:
                    out[:] = 0
                    put_s, get_s = await cache_round(clients[k], f"bench-{chunk_mib}-{i}",
                                                     data, out)
                    times[k].append((raw_put, raw_get, put_s, get_s))
        finally:
            for client in clients:
                await client.close()
        results.append((chunk_mib, times))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cache_bench")
    parser.add_argument("--size", type=parse_bytes, default=256 * MIB)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compare", default=None, metavar="ARGS",
                        help='a second cache server\'s extra flags, e.g. "--buffer-pool 0"')
    args = parser.parse_args(argv)
    tune_malloc()
    size = args.size // MIB * MIB
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)

    listener = socket.create_server(("127.0.0.1", 0))
    raw = multiprocessing.get_context("fork").Process(target=_raw_server, args=(listener,),
                                                      daemon=True)
    raw.start()
    budget = size + 64 * MIB
    variants: list[tuple[str, list[str]]] = [("", [])]
    if args.compare is not None:
        variants.insert(0, (args.compare, args.compare.split()))
    servers = [start_cache(budget, extra) for _, extra in variants]
    idle_kib = [vm_kib(proc.pid, "VmRSS") for proc, _ in servers]
    try:
        results = asyncio.run(run_rounds([address for _, address in servers],
                                         listener.getsockname()[1], data, args.rounds))
        peak_kib = [vm_kib(proc.pid, "VmHWM") for proc, _ in servers]
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(30)
        raw.kill()

    mib = size / MIB
    med = statistics.median
    print(f"snapshot {mib:.0f} MiB over loopback, {os.cpu_count()} CPUs, "
          f"median of {args.rounds} rounds (ratio = raw time / cache time, same round)")
    label_width = max(len(label) for label, _ in variants) + 2
    print(f"{'chunk':<8}{'server':<{label_width}}{'raw put':>9}{'raw get':>9}"
          f"{'put MiB/s':>11}{'get MiB/s':>11}{'put ratio':>11}{'get ratio':>11}")
    for chunk_mib, per_server in results:
        for (label, _), times in zip(variants, per_server, strict=True):
            print(f"{f'{chunk_mib} MiB':<8}{label or 'default':<{label_width}}"
                  f"{med(mib / t[0] for t in times):>9.0f}{med(mib / t[1] for t in times):>9.0f}"
                  f"{med(mib / t[2] for t in times):>11.0f}{med(mib / t[3] for t in times):>11.0f}"
                  f"{med(t[0] / t[2] for t in times):>11.2f}"
                  f"{med(t[1] / t[3] for t in times):>11.2f}")
    for (label, _), idle, peak in zip(variants, idle_kib, peak_kib, strict=True):
        print(f"cache server ({label or 'default'}) RSS: idle {idle / 1024:.0f} MiB, "
              f"peak {peak / 1024:.0f} MiB (memory budget {budget / MIB:.0f} MiB)")
    print(f"client peak {vm_kib(os.getpid(), 'VmHWM') / 1024:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
