"""The whole stack over TLS, as real processes: mutual TLS between the
services (the worker and the cache take only certificates their CA signed),
TLS and a bearer token on the public API, and the preemption oracle still
holding through it."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import trustme
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from kvstash import errors
from kvstash.cache_sdk.cache_client import CacheClient
from kvstash.client import Client
from kvstash.common import rpc_connections
from kvstash.common.security import PLAINTEXT, Security, Tls
from kvstash.launch.stack import StackConfig, running_stack
from tests.integration.workload import (
    PRESSURED_BLOCKS,
    PRESSURED_SCHEDULER_ARGS,
    cache_stats,
    expected_outputs,
    run_workload,
)

TOKEN = "integration-token"


def tls_flags(ca: trustme.CA, directory: Path, name: str) -> tuple[str, ...]:
    cert = ca.issue_cert(name, "127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(directory / f"{name}.pem"))
    cert.private_key_pem.write_to_path(str(directory / f"{name}.key"))
    return ("--tls-cert", str(directory / f"{name}.pem"), "--tls-key",
            str(directory / f"{name}.key"), "--tls-ca", str(directory / "ca.pem"))


def peer(ca: trustme.CA, name: str) -> Security:
    cert = ca.issue_cert(name, "127.0.0.1")
    return Security(Tls(ca.cert_pem.bytes(), cert.cert_chain_pems[0].bytes(),
                        cert.private_key_pem.bytes()))


async def test_stack_over_mutual_tls_with_a_token(tmp_path: Path) -> None:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    (tmp_path / "tokens").write_text(TOKEN + "\n")
    config = StackConfig(
        num_blocks=PRESSURED_BLOCKS, preemption_mode="offload",
        scheduler_args=(*PRESSURED_SCHEDULER_ARGS, *tls_flags(ca, tmp_path, "scheduler"),
                        "--auth-token-file", str(tmp_path / "tokens")),
        worker_args=tls_flags(ca, tmp_path, "worker"),
        cache_args=tls_flags(ca, tmp_path, "cache"),
    )
    user = Security(Tls(ca.cert_pem.bytes()), token=TOKEN)
    with running_stack(config, tmp_path) as stack:
        outcome = await run_workload(stack.address, user)
        assert [r.token_ids for r in outcome.results] == expected_outputs()
        assert outcome.stats.num_preemptions_offload > 0
        assert outcome.stats.num_offload_failures == outcome.stats.num_restore_failures == 0
        cache = await cache_stats(stack.cache.address, peer(ca, "operator"))
        assert cache.num_puts > 0

        # Who else gets in: nobody.
        async with Client(stack.address, Security(Tls(ca.cert_pem.bytes()))) as no_token:
            with pytest.raises(errors.KvstashError, match="bearer token") as refused:
                await no_token.stats()
            assert refused.value.code == "UNAUTHENTICATED"
        async with Client(stack.address, Security(token=TOKEN)) as plaintext:
            with pytest.raises(errors.Unavailable) as unreachable:
                await plaintext.stats()
            assert unreachable.value.code == "UNAVAILABLE"
        # The gateway protocol on the same port asks for the same token.
        for security, code in ((user, None), (Security(Tls(ca.cert_pem.bytes())),
                                              grpc.StatusCode.UNAUTHENTICATED)):
            async with rpc_connections.channel(stack.address, security) as channel:
                engine = vllm_engine_pb2_grpc.VllmEngineStub(channel)
                try:
                    info = await engine.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest())
                    assert code is None and info.served_model_name == "tiny"
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == code, exc
        for address in (stack.cache.address, stack.worker.address):
            for stranger in (Security(Tls(ca.cert_pem.bytes())), PLAINTEXT,
                             peer(trustme.CA(), "intruder")):
                async with CacheClient(address, security=stranger, timeout_s=5) as client:
                    with pytest.raises(errors.Unavailable):
                        await client.stats()
