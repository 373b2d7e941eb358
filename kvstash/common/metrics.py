"""Prometheus exposition shared by the services.

Counters and gauges are read from a service's own stats snapshot at scrape
time, so they can never drift from what its GetStats RPC reports and cost
nothing between scrapes. The HTTP server runs on its own thread; the stats
are taken on the service's event loop, which owns them. A scrape while that
loop is blocked answers without them (histograms still) and logs a warning,
rather than failing as a whole.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstash.common.binding import BindError, in_use
from kvstash.common.stats import Kind, Stat
from kvstash.errors import preview

log = logging.getLogger(__name__)

# How long a scrape waits for the service's event loop to take a snapshot.
# The scheduler reads two, and both must fit in Prometheus's default 10 s
# scrape timeout with the rest of the scrape.
_LOOP_WAIT_S = 2.0


class StatsCollector(Collector):
    """A metric named `prefix + stat.metric` for each exported stat of `stats`
    (kvstash.common.stats), valued from the same field of `read()`'s snapshot."""

    def __init__(self, prefix: str, read: Callable[[], Any], loop: asyncio.AbstractEventLoop,
                 stats: Sequence[Stat]) -> None:
        self._read = read
        self._loop = loop
        self._exported = [(prefix + s.metric, s) for s in stats if s.metric is not None]

    def describe(self) -> Iterator[Metric]:
        """The families `collect` yields, without values: what the registry
        matches a scrape's name filter (/metrics?name[]=...) against, which
        without this found none of them."""
        for name, stat in self._exported:
            yield _family(stat)(name, stat.doc)

    def collect(self) -> Iterator[Metric]:
        async def read() -> Any:
            return self._read()

        future = asyncio.run_coroutine_threadsafe(read(), self._loop)
        try:
            snapshot = future.result(timeout=_LOOP_WAIT_S)
        except TimeoutError:
            # The rest of the scrape (histograms, labelled counters) needs no
            # loop: serve it; these figures are missing until the loop answers.
            future.cancel()
            log.warning("/metrics: the event loop did not answer within %g s; %s and the "
                        "other figures read there are left out of this scrape",
                        _LOOP_WAIT_S, self._exported[0][0])
            return
        for name, stat in self._exported:
            yield _family(stat)(name, stat.doc, value=getattr(snapshot, stat.name))


def _family(stat: Stat) -> type[CounterMetricFamily] | type[GaugeMetricFamily]:
    return CounterMetricFamily if stat.kind is Kind.COUNTER else GaugeMetricFamily


# Where /metrics listens unless told otherwise: this host only.
DEFAULT_METRICS_HOST = "127.0.0.1"
# Histogram buckets, in seconds, of a KV transfer (an offload, restore, put or
# get): from a small snapshot over loopback (~1 ms) to one that waited for room.
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")


def listen_host(text: str, what: str = "host") -> str:
    """`text` if it is an IP address or host name to listen on ("127.0.0.1",
    "0.0.0.0", "::", "metrics.local"); ValueError naming `what` otherwise."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        if not _HOSTNAME.fullmatch(text):
            raise ValueError(
                f"{what} {preview(text)} is not an IP address or host name (127.0.0.1 "
                "for this host only, 0.0.0.0 for every interface)") from None
    return text


class MetricsServer:
    """`/metrics` over HTTP on `port` for the collectors of `registry`;
    BindError (kvstash.common.binding) if another process listens there."""

    def __init__(self, registry: CollectorRegistry, port: int, addr: str) -> None:
        self.registry = registry
        # Python's HTTP server never sets SO_REUSEPORT: a taken port fails here.
        try:
            self._http_server, _thread = start_http_server(port, addr=addr, registry=registry)
        except OSError as exc:
            shown = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
            if exc.errno == errno.EADDRINUSE:
                raise in_use(f"{shown} (/metrics)") from None
            raise BindError(f"cannot serve /metrics on {shown}: {exc.strerror}") from None

    @property
    def port(self) -> int:
        return int(self._http_server.server_port)

    def stop(self) -> None:
        self._http_server.shutdown()
        self._http_server.server_close()
