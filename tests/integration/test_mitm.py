"""A man in the middle on loopback (tests/mitm.py) against sealed frames: after an
untouched key handshake it flips a bit of a header, map or payload, injects a forged
frame, replays one or reorders two, in either direction. Every case is detected: the
connection is dropped, the reader never gets a wrong byte (a read either returns the
server's bytes or fails), the server never runs a tampered or injected request, and the
side that noticed logs it. Both suites, the trio client and the blocking one; then the
attack the wire MACs stop, on a real cluster (a chmod rewritten on its way to the metaserver)."""
from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from pfs.core import auth
from pfs.core.wire.connect import open_blocking, open_rpc
from pfs.core.wire.protocol import Kind
from pfs.core.wire.rpc import ConnContext, Reply, Request, RpcService
from tests.mitm import Attack, Frame, forged, proxy

TIMEOUT = 30
DATA = bytes(range(256)) * 64  # 16 KiB a read returns
WRITTEN = os.urandom(100_000)  # what a write sends
LEGIT_MODES = {0o600, 0o640}


class Target(RpcService):
    """What the attacker is after: a mode it wants changed, bytes a reader trusts."""

    name = "target"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.modes: list[int] = []
        self.writes: list[bytes] = []

    async def rpc_setmode(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        self.modes.append(req.int("mode"))
        return {"ok": True}

    async def rpc_read(self, ctx: ConnContext, req: Request) -> Reply:
        return Reply({"n": len(DATA)}, payload=DATA)

    async def rpc_write(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        self.writes.append(bytes(req.payload or b""))
        return {"n": len(req.payload or b"")}


def inject_for(direction: str) -> Callable[[Frame], bytes]:
    if direction == "c2s":  # the attack: a request the client never made
        return lambda f: forged(Kind.REQUEST, f.rid + 1000, {"m": "setmode", "mode": 0o666})
    return lambda f: forged(Kind.REPLY, f.rid, {"n": len(DATA)}, b"POISONED" * 2048)


ATTACKS = [(w, p) for w in ("flip",) for p in ("header", "map", "payload")] + \
    [("inject", "map"), ("replay", "map"), ("reorder", "map")]


def keyed(tmp_path: Path, suite: str) -> tuple[auth.ServerAuth, auth.ClientAuth]:
    path = tmp_path / "k.key"
    auth.create_key(path)
    key = auth.read_secret_file(path)
    return (auth.ServerAuth({"n": (key, auth.Identity("n", "client"))}, wire=suite),
            auth.ClientAuth("n", key, wire=suite))


def run(fn: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        with trio.fail_after(TIMEOUT):
            await fn()

    trio.run(main)


def check_outcome(service: Target, attack: Attack, errors: list[OSError], reads: list[bytes],
                  caplog: pytest.LogCaptureFixture) -> None:
    assert attack.done, "the attack never found its target frame"
    assert errors, "the tampering went unnoticed"
    assert all(r == DATA for r in reads), "a reader got bytes the server never sent"
    assert set(service.modes) <= LEGIT_MODES, f"a forged or tampered request ran: {service.modes}"
    assert all(w == WRITTEN for w in service.writes), "a tampered write was accepted"
    assert "failed authentication" in caplog.text, caplog.text
    if attack.direction == "s2c":  # the client noticed: it says so
        assert any(e.errno == errno.EBADMSG for e in errors), errors


@pytest.mark.parametrize("suite", ["mac", "encrypt"])
@pytest.mark.parametrize("direction", ["c2s", "s2c"])
@pytest.mark.parametrize("what,part", ATTACKS)
def test_trio_client_detects_every_tampering(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                             suite: str, direction: str, what: str,
                                             part: str) -> None:
    caplog.set_level(logging.WARNING)
    server_auth, client_auth = keyed(tmp_path, suite)
    service = Target(auth=server_auth)
    attack = Attack(direction, what, part, at=1, forge=inject_for(direction))
    errors: list[OSError] = []
    reads: list[bytes] = []

    async def main() -> None:
        async with trio.open_nursery() as n:
            port = await n.start(service.serve, "127.0.0.1", 0)
            async with proxy(port, attack) as pport:
                rpc = await open_rpc(client_auth, n, "127.0.0.1", pport, timeout=5)
                assert rpc.conn.suite == ("aes128-gmac" if suite == "mac" else "aes128-gcm")

                async def call(method: str, **kw: Any) -> None:
                    try:
                        if method == "read":
                            buf = bytearray(len(DATA))
                            res = await rpc.call("read", into=memoryview(buf))
                            reads.append(bytes(buf[:res.nbytes]))
                        elif method == "write":
                            await rpc.call("write", payload=WRITTEN)
                        else:
                            await rpc.call(method, kw)
                    except OSError as exc:
                        errors.append(exc)

                await call("setmode", mode=0o600)  # frame 0 each way: untouched
                async with trio.open_nursery() as calls:  # two in flight: reorderable
                    calls.start_soon(call, "read")
                    calls.start_soon(call, "write")
                await call("setmode", mode=0o640)
                await call("read")
                assert not rpc.alive, "the connection survived a tampered frame"
                rpc.close()
            n.cancel_scope.cancel()

    run(main)
    check_outcome(service, attack, errors, reads, caplog)


@pytest.mark.parametrize("suite", ["mac", "encrypt"])
@pytest.mark.parametrize("direction", ["c2s", "s2c"])
@pytest.mark.parametrize("what,part", [a for a in ATTACKS if a[0] != "reorder"])
def test_blocking_client_detects_every_tampering(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture, suite: str,
                                                 direction: str, what: str, part: str) -> None:
    """One call at a time: nothing to reorder, the rest as for the trio client."""
    caplog.set_level(logging.WARNING)
    server_auth, client_auth = keyed(tmp_path, suite)
    service = Target(auth=server_auth)
    attack = Attack(direction, what, part, at=1, forge=inject_for(direction))
    errors: list[OSError] = []
    reads: list[bytes] = []

    def client(port: int) -> None:
        rpc = open_blocking(client_auth, "127.0.0.1", port, timeout=5)
        try:
            for method in ("setmode", "read", "write", "setmode", "read", "setmode"):
                try:
                    if method == "read":
                        buf = bytearray(len(DATA))
                        _, n = rpc._exchange({"m": "read"}, None, memoryview(buf))
                        reads.append(bytes(buf[:n]))
                    elif method == "write":
                        rpc._exchange({"m": "write"}, WRITTEN, None)
                    else:
                        rpc.call("setmode", {"mode": 0o600})
                except OSError as exc:
                    errors.append(exc)
            assert not rpc.alive or rpc.conn.closed
        finally:
            rpc.close()

    async def main() -> None:
        async with trio.open_nursery() as n:
            port = await n.start(service.serve, "127.0.0.1", 0)
            async with proxy(port, attack) as pport:
                await trio.to_thread.run_sync(client, pport)
            n.cancel_scope.cancel()

    run(main)
    check_outcome(service, attack, errors, reads, caplog)


def test_blocking_reads_into_a_buffer_get_no_poisoned_byte(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    """The blocking client's read path (a reply's payload into the caller's buffer):
    a flipped payload byte fails the call, EBADMSG."""
    caplog.set_level(logging.WARNING)
    server_auth, client_auth = keyed(tmp_path, "mac")
    service = Target(auth=server_auth)
    attack = Attack("s2c", "flip", "payload", at=0)
    got: list[Any] = []

    def client(port: int) -> None:
        rpc = open_blocking(client_auth, "127.0.0.1", port, timeout=5)
        buf = bytearray(len(DATA))
        try:
            rpc._exchange({"m": "read"}, None, memoryview(buf))
            got.append(bytes(buf))
        except OSError as exc:
            got.append(exc)
        finally:
            rpc.close()

    async def main() -> None:
        async with trio.open_nursery() as n:
            port = await n.start(service.serve, "127.0.0.1", 0)
            async with proxy(port, attack) as pport:
                await trio.to_thread.run_sync(client, pport)
            n.cancel_scope.cancel()

    run(main)
    [result] = got
    assert isinstance(result, OSError) and result.errno == errno.EBADMSG, result
    assert "failed authentication" in caplog.text


def test_a_changed_negotiation_leaves_the_sides_unable_to_talk(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture
                                                                ) -> None:
    """A proxy that rewrites the handshake cannot forge its proofs, and what it changed
    goes into the session keys: here it tells the server the client offers MAC only and
    tells the client the server picked encryption. Each side thinks it agreed, their keys
    differ, and the first frame is refused."""
    caplog.set_level(logging.WARNING)
    server_auth, client_auth = keyed(tmp_path, "mac")
    client_auth.wire = "encrypt"
    service = Target(auth=server_auth)
    errors: list[OSError] = []

    def offer_mac_only(fields: dict[str, Any]) -> dict[str, Any]:
        if "s" in fields:
            fields["s"] = ["aes128-gmac"]
        return fields

    def picked_encryption(fields: dict[str, Any]) -> dict[str, Any]:
        if "s" in fields:
            fields["s"] = "aes128-gcm"
        return fields

    async def main() -> None:
        async with trio.open_nursery() as n:
            port = await n.start(service.serve, "127.0.0.1", 0)
            # two proxies in a row: one rewrites each direction
            async with proxy(port, Attack("s2c", "none", handshake=picked_encryption)) as p1, \
                    proxy(p1, Attack("c2s", "none", handshake=offer_mac_only)) as p2:
                try:
                    rpc = await open_rpc(client_auth, n, "127.0.0.1", p2, timeout=5)
                    await rpc.call("setmode", {"mode": 0o666})
                except OSError as exc:
                    errors.append(exc)
            n.cancel_scope.cancel()

    run(main)
    assert errors and service.modes == []
    assert "failed authentication" in caplog.text


def test_a_downgrade_to_plain_frames_is_refused_by_the_client(tmp_path: Path) -> None:
    """Stripping the client's offer (the server then takes it for a pfs from before wire
    security) or the server's pick: the side that asked for sealed frames refuses."""
    server_auth, client_auth = keyed(tmp_path, "none")
    client_auth.wire = "mac"
    service = Target(auth=server_auth)
    errors: list[OSError] = []

    def strip(fields: dict[str, Any]) -> dict[str, Any]:
        fields.pop("s", None)
        return fields

    async def main() -> None:
        async with trio.open_nursery() as n:
            port = await n.start(service.serve, "127.0.0.1", 0)
            for direction in ("c2s", "s2c"):
                async with proxy(port, Attack(direction, "none", handshake=strip)) as pport:
                    try:
                        await open_rpc(client_auth, n, "127.0.0.1", pport, timeout=5)
                    except OSError as exc:
                        errors.append(exc)
            n.cancel_scope.cancel()

    run(main)
    assert len(errors) == 2 and all(e.errno == errno.EPROTO for e in errors), errors
    assert all("does not authenticate frames" in str(e) for e in errors), errors
    assert service.modes == []


def test_chmod_rewritten_on_the_way_to_the_metaserver(private_cluster: Path,
                                                      tmp_path: Path) -> None:
    """The downgrade attack on a real cluster: a proxy in front of the metaserver turns
    the client's ``setattr mode=0600`` into 0666 on the wire. The metaserver refuses
    the frame and drops the connection; the mode is never 0666."""
    import pfs
    from pfs.core.config import ClientConfig, dump, load
    from pfs.tools import cluster

    cluster.up(private_cluster, data_servers=1)
    cfg = load(ClientConfig, private_cluster / "client.toml")
    with pfs.connect(config=private_cluster / "client.toml") as c:
        c.write_file("/secret", b"s")
        c.chmod("/secret", 0o640)
    meta_host, meta_port = cfg.meta_addr

    class Rewrite(Attack):
        def apply(self, i: int, f: Frame) -> list[bytes]:
            raw = f.raw
            # mode 0600 of a regular file, as msgpack packs it (uint16 0x8180 or 0x0180)
            for old, new in ((b"\xcd\x81\x80", b"\xcd\x81\xb6"), (b"\xcd\x01\x80", b"\xcd\x01\xb6")):
                if old in raw:
                    self.done = True
                    return [raw.replace(old, new, 1)]
            return [raw]

    attack = Rewrite("c2s", "flip")
    results: list[Any] = []

    async def main() -> None:
        async with proxy(meta_port, attack) as pport:
            cfg.meta = f"{meta_host}:{pport}"
            cfg.direct_meta = True
            path = tmp_path / "via-proxy.toml"
            path.write_text(dump(cfg))

            def chmod() -> None:
                with pfs.connect(config=path) as c:
                    try:
                        c.chmod("/secret", 0o600)
                        results.append("ok")
                    except OSError as exc:
                        results.append(exc)

            await trio.to_thread.run_sync(chmod)

    run(main)
    assert attack.done, "the proxy never saw the chmod"
    with pfs.connect(config=private_cluster / "client.toml") as c:
        mode = stat.S_IMODE(c.stat("/secret").st_mode)
    assert mode in (0o600, 0o640), oct(mode)  # never 0666
    assert "failed authentication" in (private_cluster / "logs" / "meta.log").read_text()
