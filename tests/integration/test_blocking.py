"""The blocking metadata connection of the synchronous client (pfs/core/wire/blocking.py):
against scripted misbehaving peers, and against the real cluster."""
from __future__ import annotations

import errno
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import pfs
from pfs.core.messages.meta import Release
from pfs.core.wire.blocking import BlockingConnection, BlockingRpcClient
from pfs.core.wire.protocol import (
    HEADER,
    MAGIC,
    VERSION,
    FrameHead,
    Kind,
    Limits,
    Peer,
    encode_frame,
)
from tests.conftest import run_threads


def _requests(sock: socket.socket, peer: Peer) -> Iterator[int]:
    """Request ids as they arrive on ``sock`` until it closes."""
    while True:
        data = sock.recv(65536)
        if not data:
            return
        for head, _ in peer.receive(data):
            assert head.kind == Kind.REQUEST
            yield head.rid


@pytest.fixture
def scripted() -> Iterator[Callable[[Callable[[socket.socket], None]], BlockingRpcClient]]:
    """A peer on loopback that runs ``script(sock)`` on the one connection it accepts."""
    threads: list[threading.Thread] = []
    clients: list[BlockingRpcClient] = []

    def start(script: Callable[[socket.socket], None], timeout: float = 10.0,
              limits: Limits | None = None) -> BlockingRpcClient:
        lsock = socket.create_server(("127.0.0.1", 0))
        port = lsock.getsockname()[1]

        def run() -> None:
            with lsock:
                sock, _ = lsock.accept()
                with sock:
                    script(sock)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        threads.append(t)
        client = BlockingRpcClient(BlockingConnection.open("127.0.0.1", port, limits,
                                                           timeout=timeout))
        clients.append(client)
        return client

    yield start
    for c in clients:
        c.close()
    for t in threads:
        t.join(timeout=10)


def test_replies_and_error_frames(scripted) -> None:
    def script(sock: socket.socket) -> None:
        for i, rid in enumerate(_requests(sock, Peer())):
            if i == 0:
                sock.sendall(encode_frame(Kind.REPLY, rid, {"n": rid}))
            else:
                sock.sendall(encode_frame(Kind.ERROR, rid, {"errno": errno.ENOENT,
                                                            "msg": "no such entry: /x"}))

    c = scripted(script)
    assert c.call("stat", {"path": b"/"}) == {"n": 1}
    with pytest.raises(FileNotFoundError, match="no such entry: /x"):
        c.call("stat", {"path": b"/x"})
    assert c.alive  # an error reply leaves the connection usable
    with pytest.raises(FileNotFoundError):
        c.call("stat", {"path": b"/x"})


@pytest.mark.parametrize("reply", [
    pytest.param(lambda rid: encode_frame(Kind.REPLY, rid + 1, {}), id="wrong-request-id"),
    pytest.param(lambda rid: b"XX" + bytes(40), id="bad-magic"),
    pytest.param(lambda rid: HEADER.pack(MAGIC, VERSION, int(Kind.REPLY), 0, 1 << 30, rid, 0),
                 id="oversized-map"),
    pytest.param(lambda rid: encode_frame(Kind.REQUEST, rid, {"m": "x"}), id="request-as-reply"),
    pytest.param(lambda rid: encode_frame(Kind.REPLY, rid, {}, b"abc"), id="reply-payload"),
])
def test_a_garbled_reply_fails_the_call_and_closes(scripted, reply) -> None:
    def script(sock: socket.socket) -> None:
        for rid in _requests(sock, Peer()):
            sock.sendall(reply(rid))
            return

    c = scripted(script)
    with pytest.raises(OSError) as err:
        c.call("getattr", {"ino": 1})
    assert err.value.errno == errno.EPROTO
    assert not c.alive


def test_a_silent_server_times_out(scripted) -> None:
    done = threading.Event()

    def script(sock: socket.socket) -> None:
        done.wait(10)  # reads nothing, answers nothing

    c = scripted(script, timeout=0.3)
    with pytest.raises(OSError) as err:
        c.call("getattr", {"ino": 1})
    done.set()
    assert err.value.errno == errno.ETIMEDOUT
    assert not c.alive  # the late reply must not be taken for the next call's


def test_a_peer_closing_an_idle_connection_is_noticed(scripted) -> None:
    def script(sock: socket.socket) -> None:
        for rid in _requests(sock, Peer()):
            sock.sendall(encode_frame(Kind.REPLY, rid, {}))
            return  # and close

    c = scripted(script)
    c.call("hello")
    for _ in range(200):
        if not c.alive:
            break
        threading.Event().wait(0.01)
    assert not c.alive
    with pytest.raises(OSError) as err:
        c.call("hello")
    assert err.value.errno == errno.ECONNRESET


def test_connecting_to_nothing_names_the_server() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(OSError, match=f"127.0.0.1:{port}") as err:
        BlockingConnection.open("127.0.0.1", port)
    assert err.value.errno == errno.ECONNREFUSED


# ---------------------------------------------------------------------------- cluster
def test_metadata_calls_stay_in_the_calling_thread(client_toml: Path) -> None:
    """With direct_meta (the default) no metadata call goes through the trio thread."""
    with pfs.connect(config=client_toml) as c:
        assert c.aio.meta.direct
        hops: list[object] = []
        real = c._loop.run

        def counting(fn, *args):
            hops.append(fn)
            return real(fn, *args)

        c._loop.run = counting  # type: ignore[method-assign]
        d = f"/direct-{id(c)}"
        c.mkdir(d)
        with c.open(f"{d}/f", "xb") as f:
            assert f.size == 0
        c.rename(f"{d}/f", f"{d}/g")
        c.chmod(f"{d}/g", 0o600)
        c.setxattr(f"{d}/g", "user.k", b"v")
        assert c.getxattr(f"{d}/g", "user.k") == b"v"
        st = c.stat(f"{d}/g")
        assert st.st_mode & 0o777 == 0o600 and st.st_size == 0
        assert c.listdir(d) == ["g"]
        with pytest.raises(FileExistsError):
            c.open(f"{d}/g", "xb")
        c.remove(f"{d}/g")
        assert not c.exists(f"{d}/g")
        c.rmdir(d)
        assert hops == []
        # data still goes through the loop, and the handle's close comes back here
        with c.open(f"{d}-data", "wb") as f:
            f.write(b"abc")
        assert len(hops) == 1
        assert c.read_file(f"{d}-data") == b"abc"
        c.remove(f"{d}-data")


def test_direct_meta_off_goes_through_the_loop(client_toml: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "client.toml"
    text = client_toml.read_text()
    assert "direct_meta = true" in text
    cfg.write_text(text.replace("direct_meta = true", "direct_meta = false"))
    with pfs.connect(config=cfg) as c:
        assert not c.aio.meta.direct
        hops: list[object] = []
        real = c._loop.run
        c._loop.run = lambda fn, *a: hops.append(fn) or real(fn, *a)  # type: ignore[method-assign,func-returns-value]
        d = f"/indirect-{id(c)}"
        c.mkdir(d)
        with c.open(f"{d}/f", "xb"):
            pass
        assert c.listdir(d) == ["f"]
        c.remove(f"{d}/f")
        c.rmdir(d)
        assert len(hops) >= 6


def test_threads_share_one_direct_client(client: pfs.Client, workdir: str) -> None:
    def worker(t: int) -> None:
        for i in range(40):
            p = f"{workdir}/t{t}-{i}"
            with client.open(p, "xb") as f:
                f.write(b"x" * i)
            assert client.stat(p).st_size == i
            if i % 2:
                client.remove(p)

    errors = run_threads(worker, 6)
    assert errors == []
    names = client.listdir(workdir)
    assert sorted(names) == sorted(f"t{t}-{i}" for t in range(6) for i in range(0, 40, 2))


def test_an_interrupted_call_drops_the_connection(scripted) -> None:
    """A call interrupted between request and reply (Ctrl-C) must not leave the reply
    to be taken for the next call's."""
    answer = threading.Event()

    def script(sock: socket.socket) -> None:
        for rid in _requests(sock, Peer()):
            answer.wait(10)
            sock.sendall(encode_frame(Kind.REPLY, rid, {"for": rid}))

    c = scripted(script)

    class Interrupted(BaseException):
        pass

    real = c.conn.recv_head

    def interrupted_recv(first: int = 0) -> None:
        raise Interrupted

    c.conn.recv_head = interrupted_recv  # type: ignore[method-assign]
    with pytest.raises(Interrupted):
        c.call("getattr", {"ino": 1})
    c.conn.recv_head = real  # type: ignore[method-assign]
    answer.set()
    assert not c.alive
    with pytest.raises(OSError) as err:
        c.call("getattr", {"ino": 2})
    assert err.value.errno == errno.ECONNRESET


def test_asking_alive_during_a_call_leaves_its_tls_reply_alone(tmp_path: Path) -> None:
    """The metaserver connection is shared by the caller's threads and the trio thread
    (a renewal, fsync's commit): one asking ``alive`` while another's call waits for its
    reply must not read from the TLS socket under it (a byte of the reply is consumed
    and the connection closed, or two threads drive one SSL object)."""
    import time

    from pfs.core.auth import client_tls, server_tls
    from pfs.tools import certs

    certs.generate(tmp_path, clients=["c"])
    sctx = server_tls(str(tmp_path / "server.pem"), str(tmp_path / "server.key"),
                      str(tmp_path / "ca.pem"))
    cctx = client_tls(str(tmp_path / "c.pem"), str(tmp_path / "c.key"),
                      str(tmp_path / "ca.pem"))
    lsock = socket.create_server(("127.0.0.1", 0))
    replied = threading.Event()

    def serve() -> None:
        with lsock:
            sock, _ = lsock.accept()
            with sctx.wrap_socket(sock, server_side=True) as s:
                for rid in _requests(s, Peer()):
                    s.sendall(encode_frame(Kind.REPLY, rid, {"for": rid}))
                    replied.set()

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    c = BlockingRpcClient(BlockingConnection.open("127.0.0.1", lsock.getsockname()[1],
                                                  timeout=10, tls=cctx))
    real = c.conn.recv_head
    go = threading.Event()

    def descheduled_recv(first: int = 0) -> FrameHead | None:
        go.wait(10)  # the caller sent its request and has not read on yet
        return real(first)

    c.conn.recv_head = descheduled_recv  # type: ignore[method-assign]
    got: list[object] = []
    caller = threading.Thread(target=lambda: got.append(c.call("getattr", {"ino": 1})))
    caller.start()
    try:
        assert replied.wait(10)
        time.sleep(0.1)  # the reply waits on the socket
        assert c.alive
    finally:
        go.set()
        caller.join(10)
    assert got == [{"for": 1}]
    c.close()
    server.join(10)


def test_a_closed_client_does_not_reconnect(client_toml: Path) -> None:
    """After close, a metadata call fails as a data call does, instead of opening a new
    metaserver connection (and handles) that nothing will close."""
    c = pfs.connect(config=client_toml)
    c.close()
    with pytest.raises(RuntimeError):
        c.stat("/")
    with pytest.raises(RuntimeError):
        c.open(f"/closed-{id(c)}", "wb")
    assert c.aio.meta._blocking is None


def test_a_release_after_close_opens_no_connection(client_toml: Path) -> None:
    """A deferred release that runs after the client closed (its timer fired in the
    window before the loop stopped) must not open a connection nothing would close."""
    c = pfs.connect(config=client_toml)
    meta = c.aio.meta
    c.close()
    with pytest.raises(OSError) as err:
        meta.request_blocking(Release())
    assert err.value.errno == errno.ENOTCONN
    assert meta._blocking is None


def test_a_connection_just_used_is_not_probed(scripted) -> None:
    """Back-to-back calls cost no liveness system call: ``alive`` asks the socket only
    once the connection was idle for ``PEER_CHECK_IDLE``, and then sees a peer that
    went away before the next request is sent."""
    import time

    from pfs.core.wire import blocking

    def script(sock: socket.socket) -> None:
        for i, rid in enumerate(_requests(sock, Peer())):
            sock.sendall(encode_frame(Kind.REPLY, rid, {}))
            if i == 2:
                return  # and close

    c = scripted(script)
    probes = []
    real = c.conn.peer_gone

    def counted() -> bool:
        probes.append(1)
        return real()

    c.conn.peer_gone = counted  # type: ignore[method-assign]
    for _ in range(3):
        assert c.alive
        c.call("hello")
    assert c.alive and probes == [1]  # only the first, on a never-used connection
    time.sleep(blocking.PEER_CHECK_IDLE + 0.05)  # idle: the next look asks the socket
    assert not c.alive and len(probes) == 2
