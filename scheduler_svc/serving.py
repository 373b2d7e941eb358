"""The scheduler's one gRPC server: kvstash.v1.Scheduler (server.py) and
vllm.grpc.engine.VllmEngine (vllm_engine.py), peers over one backend, plus
health and reflection.

Start-up order: bind, then find the worker, then `attach` the backend. Until
then both APIs answer UNAVAILABLE; health answers NOT_SERVING (for "" and
both services) whenever the engine has no worker (`set_serving`).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from grpc_health.v1 import health
from smg_grpc_proto import vllm_engine_pb2_grpc

from kvstash.common import rpc_connections, rpc_server
from kvstash.common.security import PLAINTEXT, Security
from kvstash.v1 import scheduler_pb2_grpc
from scheduler_svc.backend import Backend, BackendSlot
from scheduler_svc.server import SERVICE_NAME, SchedulerServicer
from scheduler_svc.vllm_engine import SERVICE_NAME as VLLM_SERVICE_NAME
from scheduler_svc.vllm_engine import VllmEngineServicer


@dataclass(slots=True)
class SchedulerServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    # The backend both services serve with (call it: Unavailable until attached).
    attached: BackendSlot

    def attach(self, backend: Backend) -> None:
        """Starts serving calls with `backend`."""
        self.attached.attach(backend)

    async def set_serving(self, serving: bool) -> None:
        """What the health service answers for "" and both public services."""
        await rpc_server.set_serving(self.health, [SERVICE_NAME, VLLM_SERVICE_NAME], serving)


async def create_scheduler_server(
    address: str, security: Security = PLAINTEXT,
    connections: rpc_connections.Connections = rpc_connections.DEFAULT_CONNECTIONS,
) -> SchedulerServer:
    """Binds and starts serving (TLS and tokens as `security` says),
    NOT_SERVING until a backend is attached and reports its worker up."""
    slot = BackendSlot()
    kvstash_api = SchedulerServicer(slot)
    vllm_api = VllmEngineServicer(slot)
    server, port, health_servicer = await rpc_server.create_server(
        address,
        [lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(kvstash_api, s),
         lambda s: vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(vllm_api, s)],
        [SERVICE_NAME, VLLM_SERVICE_NAME], serving=False, security=security,
        connections=connections,
    )
    return SchedulerServer(server, port, health_servicer, slot)
