"""Every service serves the standard gRPC health service and server reflection."""

from __future__ import annotations

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstash import rpc
from kvstash.stack import Stack

SERVICES = {
    "scheduler": "kvstash.v1.Scheduler",
    "worker": "kvstash.v1.Worker",
    "cache": "kvstash.v1.KVCache",
}


@pytest.mark.parametrize("name", SERVICES)
async def test_health_and_reflection(stack: Stack, name: str) -> None:
    address = getattr(stack, name).address
    async with rpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICES[name]):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = reflection.ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        reply = await call.read()
        await call.done_writing()
    names = {s.name for s in reply.list_services_response.service}
    assert {SERVICES[name], "grpc.health.v1.Health"} <= names
