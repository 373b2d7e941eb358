"""A small OpenAI-HTTP client for what the gateway (smg) serves: the demo,
the gateway benchmark and the tests call kvstash through it.

    async for event in sse_events(f"{url}/v1/completions", body | {"stream": True}):
        ...
    done = await stream_completion(url, {"model": "tiny", "prompt": "hi", "max_tokens": 8})

Plain asyncio streams, one HTTP/1.1 connection per request (closed at the
end, so leaving a stream early is a client disconnect the gateway sees).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

# What a byte-level model's text holds where bytes make no character.
REPLACEMENT = "\ufffd"
# Straight to the host named, whatever proxy the environment names (as the
# streams below go): kvstash's own services, the gateway on loopback among
# them, are never behind the proxy a user set for the internet.
open_direct = urllib.request.build_opener(urllib.request.ProxyHandler({})).open


class HttpError(RuntimeError):
    """The gateway answered with a status other than 200."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:2000].decode(errors='replace')}")
        self.status = status
        self.body = body


def request_json(url: str, body: dict[str, object] | None = None,
                 timeout_s: float = 60.0) -> Any:
    """POSTs `body` as JSON (GETs without one) and returns the parsed reply;
    HttpError on another status than 200. Blocking: use asyncio.to_thread."""
    request = urllib.request.Request(
        url, None if body is None else json.dumps(body).encode(),
        {"content-type": "application/json"})
    try:
        with open_direct(request, timeout=timeout_s) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        raise HttpError(exc.code, exc.read()) from None


class StreamError(RuntimeError):
    """A stream carried an error event instead of (the rest of) its output."""


async def sse_events(url: str, body: dict[str, object]) -> AsyncIterator[dict[str, Any]]:
    """POSTs `body` and yields each `data:` event of the reply, parsed, as it
    arrives (chunked or close-delimited). HttpError on another status than 200."""
    parts = urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
    try:
        payload = json.dumps(body).encode()
        writer.write(f"POST {target} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                     "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                     f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
                     .encode() + payload)
        await writer.drain()
        status = (await reader.readline()).decode().split()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        if len(status) < 2 or status[1] != "200":
            code = int(status[1]) if len(status) > 1 and status[1].isdigit() else 0
            raise HttpError(code, await reader.read(2000))
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        buffer = b""
        while True:
            if chunked:
                size_line = await reader.readline()
                if not size_line.endswith(b"\n"):  # the connection ended mid-reply
                    raise asyncio.IncompleteReadError(size_line, None)
                size = int(size_line.split(b";")[0], 16)
                data = (await reader.readexactly(size + 2))[:-2] if size else b""
            else:
                data = await reader.read(65536)
            if not data:
                return
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line.startswith(b"data: {"):
                    yield json.loads(line[6:])
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


@dataclass(slots=True)
class Streamed:
    """A streamed completion as the client saw it (times: time.perf_counter)."""

    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0  # from the usage event (0 without one)
    start: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # of each event with text
    finished_at: float | None = None  # the event with the finish reason


async def stream_completion(url: str, body: dict[str, object],
                            on_text: Callable[[str], None] | None = None) -> Streamed:
    """POSTs `body` to {url}/v1/completions as a stream (with usage) and
    collects it, passing each piece of text to `on_text` as it comes; raises
    StreamError, HttpError, OSError or asyncio.IncompleteReadError."""
    done = Streamed(start=time.perf_counter())
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    async for event in sse_events(f"{url}/v1/completions", body):
        if "error" in event:
            raise StreamError(json.dumps(event["error"]))
        for choice in event.get("choices") or []:
            now = time.perf_counter()
            if choice["text"]:
                done.arrivals.append(now)
                done.text += choice["text"]
                if on_text is not None:
                    on_text(choice["text"])
            if choice["finish_reason"] is not None:
                done.finish_reason, done.finished_at = choice["finish_reason"], now
        if event.get("usage"):
            done.completion_tokens = event["usage"]["completion_tokens"]
    return done
