"""Prometheus metrics: one registry for the process, one call per request.

Servers and the mount call :func:`serve` with their config's ``metrics_port`` (0: off,
the default) to expose ``/metrics`` over HTTP; the RPC layer calls :func:`rpc_done` once
per request and :func:`connections` when a connection opens or closes. Until
:func:`serve` has run those calls return at once, and ``prometheus_client`` is not even
imported (it takes a quarter of a second, which every ``pfs`` command would pay). A
server adds gauges read at scrape time (capacity, heartbeat age) with :func:`add_gauges`.

Metric names: ``pfs_rpc_requests_total{service,method}``, ``pfs_rpc_seconds{service,
method}`` (a histogram of handling time), ``pfs_rpc_errors_total{service,method,errno}``,
``pfs_rpc_bytes_in_total{service}`` / ``pfs_rpc_bytes_out_total{service}`` (request and
reply payloads), ``pfs_connections{service}``, and the gauges the servers add
(``pfs_server_total_bytes``, ``pfs_server_free_bytes``, ``pfs_server_heartbeat_age_seconds``
per data server on the metaserver; ``pfs_data_total_bytes``/``pfs_data_free_bytes`` per
directory on a data server), besides prometheus_client's process metrics.

A client (the mount, or a long-running program whose client config sets
``metrics_port``) also counts what its caches and reads did, one call per event:
``pfs_client_cache_lookups_total{cache,result}`` (:func:`cache_lookup`: the mount's
attribute and ``security.capability`` caches, the short-circuit descriptor cache),
``pfs_client_hedged_reads_total`` and ``pfs_client_hedge_wins_total`` (:func:`hedged`:
second requests sent, and those that answered first), and
``pfs_client_checksum_failures_total{route}`` (:func:`checksum_failure`); the mount
counts kernel requests by opcode, ``pfs_fuse_requests_total{op}``
(:func:`fuse_request_counter`, ``pfs.fuse.counting``); a KV-cache
client counts ``pfs_client_kv_ops_total{op,tier,result}`` and
``pfs_client_kv_bytes_total{op,tier}`` (:func:`kv_op`).

:class:`Load` is apart from all this: a few integers a data server keeps whether or not
metrics are served, for the load it reports in each heartbeat (``pfs admin status``).
"""
from __future__ import annotations

import errno as errno_mod
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

# latency buckets from 50 us (a cached stat) to 10 s (a large write to a slow disk)
_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
            0.5, 1.0, 2.5, 5.0, 10.0)
Read = Callable[[], dict[str, float]]


class _Metrics:
    """The process's metric objects, made when metrics are first served."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.requests = Counter("pfs_rpc_requests", "RPC requests handled",
                                ["service", "method"])
        self.seconds = Histogram("pfs_rpc_seconds", "RPC handling time in seconds",
                                 ["service", "method"], buckets=_BUCKETS)
        self.errors = Counter("pfs_rpc_errors", "RPC requests answered with an error",
                              ["service", "method", "errno"])
        self.bytes_in = Counter("pfs_rpc_bytes_in", "request payload bytes received",
                                ["service"])
        self.bytes_out = Counter("pfs_rpc_bytes_out", "reply payload bytes sent", ["service"])
        self.connections = Gauge("pfs_connections", "open authenticated connections",
                                 ["service"])
        self.children: dict[tuple[str, str], tuple[Any, Any]] = {}
        # the client's side (the mount, a long-running client)
        self.cache = Counter("pfs_client_cache_lookups", "client cache lookups",
                             ["cache", "result"])
        self.hedged = Counter("pfs_client_hedged_reads",
                              "reads asked of a second replica (the first was late)")
        self.hedge_wins = Counter("pfs_client_hedge_wins",
                                  "hedged reads the second replica answered first")
        self.checksum_failures = Counter("pfs_client_checksum_failures",
                                         "reads whose bytes did not match their checksums",
                                         ["route"])
        # the KV-cache client (pfs.kvcache): lookups by tier, and bytes moved
        self.kv_ops = Counter("pfs_client_kv_ops", "KV-cache client operations",
                              ["op", "tier", "result"])
        self.kv_bytes = Counter("pfs_client_kv_bytes", "KV-cache bytes put or got",
                                ["op", "tier"])
        # the FUSE mount: kernel requests by opcode (pfs.fuse.counting)
        self.fuse_requests = Counter("pfs_fuse_requests", "kernel requests the FUSE mount "
                                     "served, by opcode", ["op"])


_lock = threading.Lock()
_m: _Metrics | None = None
_gauges: dict[str, tuple[str, str, list[Read]]] = {}  # name -> doc, label, reader (latest)


def enabled() -> bool:
    return _m is not None


_served: dict[tuple[str, int], int] = {}  # (host, port asked) -> port bound


def serve(port: int, host: str = "127.0.0.1") -> int | None:
    """Expose ``/metrics`` on ``host:port`` from a daemon thread, for the rest of the
    process (0: off). Returns the bound port, or None when off. Asked again for the same
    port (a second client in one process), it serves once."""
    global _m
    if port <= 0:
        return None
    from prometheus_client import REGISTRY, start_http_server

    with _lock:
        first, _m = _m is None, _m or _Metrics()
        if (host, port) in _served:
            return _served[host, port]
    if first:
        REGISTRY.register(_Gauges())
    server, _thread = start_http_server(port, addr=host)
    bound = int(server.server_address[1])
    with _lock:
        _served[host, port] = bound
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound


def rpc_done(service: str, method: str, started: float, err: int | None, bytes_in: int,
             bytes_out: int) -> None:
    """One handled request: ``started`` is its ``time.perf_counter()``, ``err`` the errno
    it was answered with (None: success)."""
    m = _m
    if m is None:
        return
    pair = m.children.get((service, method))
    if pair is None:
        with _lock:
            pair = m.children[service, method] = (m.requests.labels(service, method),
                                                  m.seconds.labels(service, method))
    pair[0].inc()
    pair[1].observe(time.perf_counter() - started)
    if err is not None:
        m.errors.labels(service, method, errno_mod.errorcode.get(err, str(err))).inc()
    if bytes_in:
        m.bytes_in.labels(service).inc(bytes_in)
    if bytes_out:
        m.bytes_out.labels(service).inc(bytes_out)


def connections(service: str, delta: int) -> None:
    if _m is not None:
        _m.connections.labels(service).inc(delta)


def cache_lookup(cache: str, hit: bool) -> None:
    """A client cache (``attr``, ``xattr``, ``local_fd``) answered, or did not."""
    if _m is not None:
        _m.cache.labels(cache, "hit" if hit else "miss").inc()


def fuse_request_counter(op: str) -> Callable[[], None] | None:
    """The increment of ``pfs_fuse_requests_total{op}`` (None while metrics are off)."""
    return None if _m is None else _m.fuse_requests.labels(op).inc


def hedged(won: bool) -> None:
    """A read was asked of a second replica; ``won``: the second answered first."""
    if _m is not None:
        _m.hedged.inc()
        if won:
            _m.hedge_wins.inc()


def checksum_failure(route: str) -> None:
    """Bytes a client read did not match their checksums (``network``, ``local``:
    short-circuit, ``gpu``)."""
    if _m is not None:
        _m.checksum_failures.labels(route).inc()


def kv_op(op: str, tier: str, result: str, nbytes: int = 0) -> None:
    """A KV-cache client operation: ``op`` get/put/exists/remove, ``tier`` node (this
    host's shared memory) or remote (the block's home), ``result`` hit/miss/ok/error."""
    m = _m
    if m is not None:
        m.kv_ops.labels(op, tier, result).inc()
        if nbytes:
            m.kv_bytes.labels(op, tier).inc(nbytes)


class Load:
    """Requests and payload bytes served, and connections open, over intervals: what a
    data server reports in each heartbeat. Plain integers (no lock: one trio thread
    counts and samples)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.requests = self.bytes_in = self.bytes_out = self.connections = 0
        self._last = (clock(), 0, 0, 0)

    def done(self, bytes_in: int, bytes_out: int) -> None:
        self.requests += 1
        self.bytes_in += bytes_in
        self.bytes_out += bytes_out

    def sample(self) -> list[int]:
        """[requests/s, bytes in/s, bytes out/s] since the last sample, and the
        connections open now (the heartbeat's ``load``)."""
        now = self._clock()
        t, r, i, o = self._last
        dt = max(now - t, 1e-3)
        self._last = (now, self.requests, self.bytes_in, self.bytes_out)
        return [round((self.requests - r) / dt), round((self.bytes_in - i) / dt),
                round((self.bytes_out - o) / dt), self.connections]


def add_gauges(name: str, doc: str, label: str, read: Read) -> None:
    """A gauge per ``label`` value, read by ``read()`` at each scrape (in the HTTP
    thread: it must only read what is safe to read there). Added again (a second server
    in one process): the newest ``read`` serves."""
    with _lock:
        _gauges[name] = (doc, label, [read])


class _Gauges:
    """The gauges of :func:`add_gauges`, computed at scrape time."""

    def describe(self) -> list[Any]:
        return []  # names vary; and registering must not run the readers

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        with _lock:
            items = list(_gauges.items())
        for name, (doc, label, (read,)) in items:
            g = GaugeMetricFamily(name, doc, labels=[label])
            for key, value in read().items():
                g.add_metric([key], value)
            yield g
