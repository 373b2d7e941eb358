"""Every RPC of every service, fuzzed over real channels to real processes.

Hypothesis builds requests from the services' own message descriptors
(random and boundary values in every field, nested messages, oneofs, unknown
enum numbers), and sends undecodable bytes too; streamed RPCs get random
sequences of messages. Every call must end with a specific status code and
a message (never UNKNOWN or INTERNAL, never an empty error), no process may
die, and afterwards each service still serves well-formed calls with its
resident memory close to where it started.

CI runs KVSTASH_FUZZ_EXAMPLES (default 25) examples per RPC; `make fuzz`
runs 10,000.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor as pb
from google.protobuf import message_factory
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from smg_grpc_proto import vllm_engine_pb2

from kvstash.common.rpc_connections import CHANNEL_OPTIONS
from kvstash.launch.processes import Service, start_service
from kvstash.launch.stack import Stack, StackConfig, running_stack
from kvstash.v1 import cache_pb2, common_pb2, scheduler_pb2, worker_pb2

EXAMPLES = int(os.environ.get("KVSTASH_FUZZ_EXAMPLES", "25"))
CALL_TIMEOUT_S = 3.0
# A subscription never ends by itself: what the server answers at once (an
# error, the retained batches) comes within this.
SUBSCRIPTION_TIMEOUT_S = 0.2
SUBSCRIPTIONS = {"/vllm.grpc.engine.VllmEngine/SubscribeKvEvents"}
# Codes a fuzzed call may end with: each says what was wrong. DEADLINE_EXCEEDED
# is our own timeout on a call that was accepted (a long generation).
ALLOWED = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.DATA_LOSS, grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAVAILABLE,  # e.g. a restore whose snapshot the cache refused
    grpc.StatusCode.UNIMPLEMENTED,  # VllmEngine: a field or RPC kvstash does not serve
}
RSS_GROWTH_LIMIT = 256 * 2**20


@dataclass(frozen=True)
class Rpc:
    service: str  # which process: scheduler, worker or cache
    method: pb.MethodDescriptor

    @property
    def path(self) -> str:
        return f"/{self.method.containing_service.full_name}/{self.method.name}"

    def __str__(self) -> str:
        return self.path


RPCS = [Rpc(name, method)
        for name, module, service in (("scheduler", scheduler_pb2, "Scheduler"),
                                      ("scheduler", vllm_engine_pb2, "VllmEngine"),
                                      ("worker", worker_pb2, "Worker"),
                                      ("cache", cache_pb2, "KVCache"))
        for method in module.DESCRIPTOR.services_by_name[service].methods]

_INT_BOUNDS = {
    pb.FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    pb.FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    pb.FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    pb.FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    pb.FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    pb.FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    pb.FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    pb.FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    pb.FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    pb.FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def scalars(field: pb.FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind in _INT_BOUNDS:
        low, high = _INT_BOUNDS[kind]
        edges = [v for v in (0, 1, 2, 15, 16, 17, 128, 129, 1024, 4096, low, high, high - 1,
                             -1) if low <= v <= high]
        return st.sampled_from(edges) | st.integers(low, high)
    if kind == pb.FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind in (pb.FieldDescriptor.TYPE_FLOAT, pb.FieldDescriptor.TYPE_DOUBLE):
        return st.floats(width=32 if kind == pb.FieldDescriptor.TYPE_FLOAT else 64)
    if kind == pb.FieldDescriptor.TYPE_STRING:
        return st.sampled_from(["", "s", "req-1", "a" * 129, "../etc/passwd", ".hidden",
                                "x~y", "bfloat16", "float16"]) | st.text(max_size=200)
    if kind == pb.FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=4096)
    if kind == pb.FieldDescriptor.TYPE_ENUM:
        return st.integers(-1, 8)  # unknown numbers too
    return messages(field.message_type, depth + 1)


def messages(descriptor: pb.Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    cls = message_factory.GetMessageClass(descriptor)
    if depth > 3:
        return st.just(cls())
    optional = {}
    for field in descriptor.fields:
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
            optional[field.name] = st.dictionaries(scalars(key, depth), scalars(value, depth),
                                                   max_size=5)
            continue
        values = scalars(field, depth)
        optional[field.name] = st.lists(values, max_size=20) if field.is_repeated else values
    return st.fixed_dictionaries({}, optional=optional).map(lambda kw: _build(cls, kw))


def _build(cls: Any, fields: dict[str, Any]) -> Any:
    message = cls()
    for name, value in fields.items():  # one by one: a later oneof member wins
        if isinstance(value, dict):  # a map field
            entries = getattr(message, name)
            for key, item in value.items():
                if isinstance(item, Message):
                    entries[key].CopyFrom(item)
                else:
                    entries[key] = item
        elif isinstance(value, list):
            getattr(message, name).extend(value)
        elif isinstance(value, Message):
            getattr(message, name).CopyFrom(value)
        else:
            setattr(message, name, value)
    return message


def payloads(rpc: Rpc) -> st.SearchStrategy[bytes | list[bytes]]:
    """One serialized request, or several for a streamed one; sometimes bytes
    that do not decode at all."""
    one = messages(rpc.method.input_type).map(lambda m: m.SerializeToString()) | st.binary(
        max_size=2048)
    return st.lists(one, min_size=0, max_size=6) if rpc.method.client_streaming else one


# Served by a P/D decode instance; a prefill instance refuses them at once.
DECODE_RPCS = frozenset({"ReserveBlocks", "Decode"})


@dataclass
class Processes:
    stack: Stack  # P/D: Generate through a prefill instance exercises the handoff
    worker: Service  # a worker of its own: fuzzed Execute and Restore calls write its blocks

    def address(self, rpc: Rpc) -> str:
        if rpc.service == "worker":
            return self.worker.address
        if rpc.service == "cache":
            return self.stack.cache.address
        decode = self.stack.decode_scheduler
        assert decode is not None
        return decode.address if rpc.method.name in DECODE_RPCS else self.stack.address

    def all(self) -> list[Service]:
        return [*self.stack.services, self.worker]


@pytest.fixture(scope="module")
def processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processes]:
    logs = tmp_path_factory.mktemp("fuzz")
    # Both schedulers exit on a broken invariant; fuzzed reservations lapse
    # fast, and a prefill instance they crowd out decodes a request itself.
    config = StackConfig(num_blocks=64, cache_memory_budget="256MiB", pd=True,
                         scheduler_args=("--max-num-waiting", "16", "--check-integrity"),
                         prefill_scheduler_args=("--handoff-wait", "1"),
                         decode_scheduler_args=("--reservation-timeout", "2"))
    (logs / "own-worker").mkdir()
    with running_stack(config, logs) as stack:
        worker = start_service("worker", "gpu_worker", [
            "--listen", "127.0.0.1:0", "--num-blocks", "64", "--cache-address",
            stack.cache.address], logs / "own-worker")
        try:
            yield Processes(stack, worker)
        finally:
            worker.stop()


def call(channel: grpc.Channel, rpc: Rpc, payload: bytes | list[bytes]) -> grpc.StatusCode:
    """Makes the call, reading every response; returns how it ended."""
    method, path = rpc.method, rpc.path
    identity = {"request_serializer": None, "response_deserializer": None}
    timeout = SUBSCRIPTION_TIMEOUT_S if path in SUBSCRIPTIONS else CALL_TIMEOUT_S
    try:
        if method.client_streaming and method.server_streaming:
            for _ in channel.stream_stream(path, **identity)(iter(payload), timeout=timeout):
                pass
        elif method.client_streaming:
            channel.stream_unary(path, **identity)(iter(payload), timeout=timeout)
        elif method.server_streaming:
            for _ in channel.unary_stream(path, **identity)(payload, timeout=timeout):
                pass
        else:
            channel.unary_unary(path, **identity)(payload, timeout=timeout)
    except grpc.RpcError as exc:
        code = exc.code()
        assert code in ALLOWED, f"{path}: {code} {exc.details()!r}"
        assert exc.details(), f"{path}: {code} without a message"
        return code
    return grpc.StatusCode.OK


def rss(service: Service) -> int:
    """Private resident memory: RssAnon leaves out the cache's arena, which
    the worker maps (shared pages, allocated whole when the cache started)."""
    for line in Path(f"/proc/{service.process.pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


@pytest.mark.parametrize("rpc", RPCS, ids=str)
def test_fuzzed_calls_end_with_a_specific_status(processes: Processes, rpc: Rpc) -> None:
    channel = grpc.insecure_channel(processes.address(rpc), options=CHANNEL_OPTIONS)
    before = {s.name: rss(s) for s in processes.all()}
    seen: set[grpc.StatusCode] = set()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES < 1000,
              suppress_health_check=list(HealthCheck))
    @given(payloads(rpc))
    def fuzz(payload: bytes | list[bytes]) -> None:
        seen.add(call(channel, rpc, payload))
        for service in processes.all():
            assert service.process.poll() is None, f"{service.name} died on {rpc}"

    try:
        fuzz()
    finally:
        channel.close()
    assert seen, "no call was made"
    well_formed(processes)
    for service in processes.all():
        growth = rss(service) - before[service.name]
        assert growth < RSS_GROWTH_LIMIT, f"{service.name} grew {growth >> 20} MiB on {rpc}"


def well_formed(processes: Processes) -> None:
    """Each service still does its job."""
    with grpc.insecure_channel(processes.stack.address, options=CHANNEL_OPTIONS) as channel:
        request = scheduler_pb2.GenerateRequest(
            request_id=f"check-{random.getrandbits(32)}",
            sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True))
        request.token_ids.ids.extend([1, 2, 3])
        stub = channel.unary_stream(
            "/kvstash.v1.Scheduler/Generate",
            request_serializer=scheduler_pb2.GenerateRequest.SerializeToString,
            response_deserializer=scheduler_pb2.GenerateResponse.FromString)
        tokens = [t for r in stub(request, timeout=60) for t in r.token_ids]
        assert len(tokens) == 4
    with grpc.insecure_channel(processes.worker.address, options=CHANNEL_OPTIONS) as channel:
        info = channel.unary_unary("/kvstash.v1.Worker/GetInfo",
                                   request_serializer=worker_pb2.GetInfoRequest.SerializeToString,
                                   response_deserializer=worker_pb2.WorkerInfo.FromString)(
            worker_pb2.GetInfoRequest(), timeout=30)
        assert info.num_blocks == 64
    with grpc.insecure_channel(processes.stack.cache.address, options=CHANNEL_OPTIONS) as channel:
        stats = channel.unary_unary(
            "/kvstash.v1.KVCache/GetStats",
            request_serializer=common_pb2.GetStatsRequest.SerializeToString,
            response_deserializer=cache_pb2.CacheStats.FromString,
        )(common_pb2.GetStatsRequest(), timeout=30)
        assert stats.reserved_bytes == 0  # no fuzzed put left a reservation behind
