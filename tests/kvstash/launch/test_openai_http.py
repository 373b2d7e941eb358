"""The OpenAI-HTTP client against a real socket that answers as smg does:
chunked SSE with events split across chunks, an error event, a refusal, a
connection cut mid-reply."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator

import pytest

from kvstash.launch.openai_http import HttpError, StreamError, sse_events, stream_completion


def chunked(*pieces: bytes, end: bool = True) -> bytes:
    """A 200 reply whose body is `pieces`, one chunk each (with an extension)."""
    body = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces)
    return (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\n"
            b"Content-Type: text/event-stream\r\n\r\n" + body + (b"0\r\n\r\n" if end else b""))


def event(payload: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\r\n\r\n"


def choice(text: str, finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"text": text, "index": 0, "finish_reason": finish}]}


class OneReply:
    """A server that reads one request and answers `reply`, then hangs up."""

    def __init__(self) -> None:
        self.requests: list[bytes] = []
        self._server: asyncio.Server | None = None

    async def start(self, reply: bytes) -> str:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            self.requests.append(head + await reader.readexactly(length))
            writer.write(reply)
            await writer.drain()
            writer.close()

        self._server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def close(self) -> None:
        if self._server is not None:
            self._server.close()


@pytest.fixture
async def server() -> AsyncIterator[OneReply]:
    one = OneReply()
    yield one
    one.close()


async def test_events_split_across_chunks_are_put_back_together(server: OneReply) -> None:
    first, second = event(choice("hel")), event(choice("lo", "length"))
    usage = event({"choices": [], "usage": {"completion_tokens": 2}})
    url = await server.start(chunked(first[:7], first[7:] + second[:3], second[3:] + usage,
                                     b"data: [DONE]\r\n\r\n"))
    done = await stream_completion(url, {"model": "m", "prompt": "p"})
    assert (done.text, done.finish_reason, done.completion_tokens) == ("hello", "length", 2)
    assert len(done.arrivals) == 2 and done.finished_at is not None
    [request] = server.requests
    assert request.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    sent = json.loads(request.split(b"\r\n\r\n", 1)[1])
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}


async def test_an_error_event_is_raised(server: OneReply) -> None:
    url = await server.start(chunked(event(choice("a")), event({"error": {"message": "boom"}})))
    with pytest.raises(StreamError, match="boom"):
        await stream_completion(url, {"model": "m", "prompt": "p"})


async def test_a_refusal_carries_its_status_and_body(server: OneReply) -> None:
    url = await server.start(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 11\r\n\r\nno template")
    with pytest.raises(HttpError, match="no template") as err:
        async for _ in sse_events(f"{url}/v1/chat/completions", {}):
            pass
    assert err.value.status == 400


async def test_a_connection_cut_mid_reply_is_an_incomplete_read(server: OneReply) -> None:
    url = await server.start(chunked(event(choice("a")), end=False))
    with pytest.raises(asyncio.IncompleteReadError):
        await stream_completion(url, {"model": "m", "prompt": "p"})


def test_requests_to_kvstash_go_direct_whatever_proxy_the_environment_names() -> None:
    """A user's http_proxy is for the internet: the gateway on loopback (its
    readiness, JSON calls) is reached directly, as the streams are."""
    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"ready": true}')

    server = http.server.HTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/readiness"
    dead_proxy = "http://127.0.0.1:9"  # nothing listens: a proxied call is refused
    env = {**os.environ, "http_proxy": dead_proxy, "HTTP_PROXY": dead_proxy,
           "no_proxy": "", "NO_PROXY": ""}
    try:
        done = subprocess.run(
            [sys.executable, "-c", "import sys; from kvstash.launch.openai_http import "
             "request_json; print(request_json(sys.argv[1]))", url],
            check=False, env=env, capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "{'ready': True}"
