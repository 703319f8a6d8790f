"""Peer authentication: cluster and node keys with HMAC challenge-response, or mutual TLS.

Nothing is served before the peer authenticates. Three modes, chosen by configuration:

- **key** (default of ``pfs cluster up``): a key is 32 random bytes in a file of mode
  0600 (a file that group or others can read is refused). Both sides prove knowledge of
  the key with HMAC-SHA256 over fresh nonces; the key never crosses the wire::

      client -> server  request {"m": "auth", "v": [MIN, MAX], "key": NAME, "nonce": Nc}
      server -> client  reply   {"nonce": Ns, "proof": HMAC(K, "server" | NAME | Nc | Ns),
                                 "v": V}
      client -> server  request {"m": "auth_proof", "proof": HMAC(K, "client" | NAME | Nc | Ns)}
      server -> client  reply   {"name": ..., "role": ...}     (or an EACCES error, then close)

  The client checks the server's proof first, so a client with a key never talks to a
  server that does not hold it. The auth request also offers the wire-security suites
  the client accepts (``"s"``, from its ``wire_security``) and the reply names the one
  the server picked; unless that is ``none``, both sides then derive two session keys
  from K and both nonces and every later frame is authenticated, or encrypted too
  (:mod:`pfs.core.wire.seal`, docs/security.md "Wire security").
- **tls**: mutual TLS with certificates from ``pfs certs`` (one CA); a certificate's
  ``OU`` says its role and, for clients, the uid and gid ranges it may claim.
- **open**: no key and no TLS configured anywhere: every peer is trusted, data servers
  check no capabilities, and servers log a warning. For unit tests and one-user
  development only; ``pfs cluster up`` never makes such a cluster.

Protocol versions are negotiated inside these handshakes, with no round trip of their
own (pfs/core/versions.py): in key mode the auth request carries the client's range ``[MIN,
MAX]`` and the server's reply the version ``V`` it picked, the highest in both ranges
(or an ``EPROTO`` error naming its range, then close); in TLS mode each side offers its
versions as ALPN names ``pfs/N`` and TLS picks the server's first that the client has.
Every frame after the handshake carries ``V``. A peer from before negotiation (``"v":
1``, no ALPN) speaks version 1. Open mode has no handshake and stays at version 1. The
versions are not covered by the proofs: a man in the middle could at most pick a lower
version that both sides support, which changes framing, not who may do what.

Keys and roles: the *cluster key* (``cluster.key``) is held by the metaserver and the data
servers and gives the role ``server`` (register and heartbeat, nothing in the namespace).
*Node keys* are listed in the metaserver's config with the uid and gid ranges their holder
may claim and give the role ``client``. A client authenticates to data servers with its
node key's *data-plane key* ``HMAC(K, "pfs data-plane v1")``, which the metaserver hands to
data servers when they register; so a data server never learns a key that works at the
metaserver.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import ssl
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from pfs.core.config import ConfigError
from pfs.core.errors import Final, ProtocolError
from pfs.core.versions import (
    LEGACY_RANGE,
    SUPPORTED,
    Range,
    alpn_names,
    fmt_range,
    negotiate,
    no_common,
    parse_alpn,
    parse_versions,
)
from pfs.core.wire import seal
from pfs.core.wire.protocol import FrameHead, Kind
from pfs.core.wire.transport import Connection

if TYPE_CHECKING:
    from pfs.core.wire.blocking import BlockingConnection

log = logging.getLogger(__name__)

KEY_BYTES = 32
NONCE_BYTES = 32
AUTH_TIMEOUT = 10.0  # seconds a peer has to authenticate
CLUSTER = "cluster"  # the name of the cluster key
UID_MAX = (1 << 32) - 1
FULL = (0, UID_MAX)


class AuthError(Final):
    """Authentication refused: EACCES, never retried (pfs.core.errors.FAILURES)."""

    def __init__(self, msg: str) -> None:
        super().__init__(errno.EACCES, msg)


class VersionError(AuthError):
    """The peer and we share no protocol version (EPROTO); the message names both ranges."""

    def __init__(self, msg: str) -> None:
        OSError.__init__(self, errno.EPROTO, msg)


# ---------------------------------------------------------------------------
# key files
# ---------------------------------------------------------------------------
def read_secret_file(path: str | os.PathLike[str], size: int | None = KEY_BYTES) -> bytes:
    """The bytes of a secret file; refused if group or others may read it."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ConfigError(f"key file {p} does not exist") from None
    except PermissionError as exc:
        raise _not_ours(p, exc) from None
    except OSError as exc:
        raise ConfigError(f"key file {p}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"key file {p} is not a regular file")
    if st.st_mode & 0o077:
        raise ConfigError(
            f"key file {p} is accessible by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"refusing to use it. Run: chmod 600 {p}")
    try:
        data = p.read_bytes()
    except PermissionError as exc:
        raise _not_ours(p, exc) from None
    except OSError as exc:
        raise ConfigError(f"key file {p}: {exc.strerror}") from None
    if size is not None and len(data) != size:
        raise ConfigError(f"key file {p} holds {len(data)} bytes, want {size}")
    return data


def _not_ours(p: Path, exc: OSError) -> ConfigError:
    """A node's key, tried by an ordinary user: say what to do instead."""
    return ConfigError(f"key file {p}: {exc.strerror} (EACCES): this user may not read it; "
                       "a user needs a key of their own (pfs admin key create NAME --owner "
                       "USER; docs/security.md \"User keys\")")


def create_key(path: str | os.PathLike[str]) -> bool:
    """Write 32 random bytes to ``path`` (mode 0600) unless it exists; True if created."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    try:
        os.write(fd, os.urandom(KEY_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def data_plane_key(key: bytes) -> bytes:
    """What a node key's holder proves to data servers (one-way from the node key)."""
    return hmac.new(key, b"pfs data-plane v1", hashlib.sha256).digest()


def _proof(key: bytes, who: bytes, name: str, nc: bytes, ns: bytes) -> bytes:
    n = name.encode()
    msg = b"pfs-auth-1|" + who + b"|" + len(n).to_bytes(2, "big") + n + nc + ns
    return hmac.new(key, msg, hashlib.sha256).digest()


def check_wire(level: str, who: str) -> str:
    """A ``wire_security`` value, checked; ``none`` is said loudly (once, at start)."""
    if level not in seal.LEVELS:
        raise ConfigError(f"wire_security {level!r}: want one of {', '.join(seal.LEVELS)}")
    if level == "none":
        log.warning("%s: wire_security = \"none\": frames after the key handshake are "
                    "neither authenticated nor encrypted unless the peer asks for it; "
                    "anyone on the network path can read and rewrite them "
                    "(docs/security.md)", who)
    return level


def _transcript(name: str, offered: list[str], versions: object, version: int,
                suite: str) -> bytes:
    """What the handshake negotiated, as both sides saw it (the session keys' info)."""
    return "\0".join([name, ",".join(offered), repr(versions), str(version),
                      suite]).encode()


def _session(suite: str, key: bytes, nc: bytes, ns: bytes, transcript: bytes,
             server: bool, peer: str) -> seal.Session:
    c2s, s2c = seal.session_keys(key, nc, ns, transcript)
    return seal.Session(suite, *((s2c, c2s) if server else (c2s, s2c)), peer)


# ---------------------------------------------------------------------------
# identities
# ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Identity:
    """Who is at the other end of a connection."""

    name: str
    role: str  # "server", "client" or "open"
    uids: tuple[int, int] = FULL
    gids: tuple[int, int] = FULL

    @property
    def may_serve(self) -> bool:
        """May register as a data server."""
        return self.role in ("server", "open")


OPEN = Identity("open", "open")


def parse_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi if sep else lo)
    except ValueError:
        raise ConfigError(f"bad id range {text!r}: want LO-HI") from None
    if not 0 <= a <= b <= UID_MAX:
        raise ConfigError(f"bad id range {text!r}")
    return a, b


# ---------------------------------------------------------------------------
# TLS
# ---------------------------------------------------------------------------
def server_tls(cert: str, key: str, ca: str, versions: Range = SUPPORTED) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.set_alpn_protocols(alpn_names(versions))  # the protocol version, picked by TLS
    read_secret_file(key, None)  # mode check
    ctx.load_cert_chain(cert, key)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_tls(cert: str, key: str, ca: str, versions: Range = SUPPORTED) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.set_alpn_protocols(alpn_names(versions))
    ctx.check_hostname = False  # servers share one certificate; its role is checked
    read_secret_file(key, None)
    ctx.load_cert_chain(cert, key)
    return ctx


def cert_identity(cert: dict[str, Any] | None) -> Identity:
    """The identity in a verified peer certificate: ``OU=pfs:server`` or
    ``OU=pfs:client:uids=LO-HI:gids=LO-HI``."""
    if not cert:
        raise AuthError("the peer sent no certificate")
    cn, ou = "", ""
    for rdn in cert.get("subject", ()):
        for k, v in rdn:
            if k == "commonName":
                cn = v
            elif k == "organizationalUnitName":
                ou = v
    parts = ou.split(":")
    if parts[:2] == ["pfs", "server"]:
        return Identity(cn, "server")
    if parts[:2] == ["pfs", "client"]:
        uids, gids = FULL, FULL
        for p in parts[2:]:
            k, _, v = p.partition("=")
            if k == "uids":
                uids = parse_range(v)
            elif k == "gids":
                gids = parse_range(v)
        return Identity(cn, "client", uids, gids)
    raise AuthError(f"certificate {cn!r} names no pfs role (OU {ou!r})")


# ---------------------------------------------------------------------------
# the two halves of the handshake
# ---------------------------------------------------------------------------
def _check_head(head: FrameHead | None, peer: str, kind: Kind, what: str,
                ours: Range = SUPPORTED) -> tuple[int, dict[str, Any]]:
    """The id and fields of an expected handshake frame; AuthError/ProtocolError else
    (VersionError when the server refused our protocol versions)."""
    if head is None:  # an outage, not a refusal (a refusal comes as an error frame)
        raise ConnectionResetError(errno.ECONNRESET,
                                   f"{peer} closed the connection during authentication")
    if head.payload_len:
        raise ProtocolError(f"{what} carries a payload")
    if head.kind == Kind.ERROR and kind == Kind.REPLY:
        msg = head.fields.get("msg")
        if head.fields.get("errno") == errno.EPROTO:
            theirs = parse_versions(head.fields.get("v"))
            raise VersionError(f"{peer}: " + (no_common(ours, theirs, "client", "server")
                                              if theirs is not None else str(msg)))
        raise AuthError(f"{peer} refused authentication: {msg}")
    if head.kind != kind:
        raise ProtocolError(f"expected {what}, got a frame of kind {head.kind}")
    return head.rid, head.fields


async def _expect(conn: Connection, kind: Kind, what: str) -> tuple[int, dict[str, Any]]:
    return _check_head(await conn.recv_head(), conn.name, kind, what)


def _alpn(sock: Any) -> str | None:
    """The ALPN name TLS picked on a connection (trio's TlsSocket or an ssl.SSLSocket)."""
    pick = getattr(getattr(sock, "stream", sock), "selected_alpn_protocol", None)
    return pick() if pick is not None else None


def _local_name(conn: Connection) -> str:
    """host:port of our end of ``conn`` (the address the peer reached)."""
    try:
        addr = getattr(conn.sock, "raw", conn.sock).getsockname()
    except OSError:
        return "?"
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)


@dataclass
class ServerAuth:
    """How a server authenticates its peers (and which protocol versions it speaks)."""

    keys: dict[str, tuple[bytes, Identity]] = field(default_factory=dict)
    tls: ssl.SSLContext | None = None
    versions: Range = SUPPORTED  # what the TLS context offers by ALPN must match
    wire: str = "mac"  # wire_security: what frames after a key handshake must be

    @property
    def mode(self) -> str:
        return "tls" if self.tls is not None else "key" if self.keys else "open"

    async def authenticate(self, conn: Connection) -> Identity:
        if self.tls is not None:
            ident = cert_identity(getattr(conn.sock, "peer_cert", None))
            await self._tls_version(conn)
            return ident
        if not self.keys:
            return OPEN
        rid, fields = await _expect(conn, Kind.REQUEST, "an auth request")
        name, nc = fields.get("key"), fields.get("nonce")
        if fields.get("m") != "auth":
            await _refuse(conn, rid, "authentication required: this cluster needs a key "
                                "(key_file in the client config) or TLS certificates")
        fields_v = fields.get("v")
        theirs = parse_versions(fields_v)
        if theirs is None:
            await _refuse(conn, rid, "malformed auth request: bad protocol versions 'v'")
        assert theirs is not None
        version = negotiate(self.versions, theirs)
        if version is None:
            await _refuse_version(conn, rid, self.versions,
                                  no_common(self.versions, theirs, "server", "client"))
        assert version is not None
        if not isinstance(name, str) or not isinstance(nc, bytes) or len(nc) != NONCE_BYTES:
            await _refuse(conn, rid, "malformed auth request")
        entry = self.keys.get(name)  # type: ignore[arg-type]
        if entry is None:
            await _refuse(conn, rid, f"unknown key {name!r}")
        assert entry is not None and isinstance(name, str) and isinstance(nc, bytes)
        key, ident = entry
        offered = fields.get("s")
        suite = await self._suite(conn, rid, offered)
        ns = os.urandom(NONCE_BYTES)
        reply: dict[str, Any] = {"nonce": ns, "v": version,
                                 "proof": _proof(key, b"server", name, nc, ns)}
        if offered is not None:
            reply["s"] = suite
        await conn.send_frame(Kind.REPLY, rid, reply)
        rid, fields = await _expect(conn, Kind.REQUEST, "an auth proof")
        proof = fields.get("proof")
        if (fields.get("m") != "auth_proof" or not isinstance(proof, bytes)
                or not hmac.compare_digest(proof, _proof(key, b"client", name, nc, ns))):
            await _refuse(conn, rid, f"authentication with key {name!r} failed")
        await conn.send_frame(Kind.REPLY, rid, {"name": ident.name, "role": ident.role})
        conn.pin_version(version)
        if suite != seal.PLAIN:
            assert isinstance(offered, list)
            conn.install(_session(suite, key, nc, ns, _transcript(
                name, offered, fields_v, version, suite), True, conn.name))
        return ident

    async def _suite(self, conn: Connection, rid: int, offered: object) -> str:
        """The wire-security suite for a client that offered ``offered`` (None: a
        client from before wire security, which can only speak plain frames)."""
        if offered is None:
            if self.wire != "none":
                await _refuse(conn, rid, f"this server requires authenticated frames "
                              f"(wire_security = {self.wire!r}) and the client sent no "
                              "wire-security offer (a pfs from before them): upgrade the "
                              "client, or set wire_security = \"none\" on the server")
            return seal.PLAIN
        if not isinstance(offered, list) or not all(isinstance(x, str) for x in offered):
            await _refuse(conn, rid, "malformed auth request: bad wire-security offer 's'")
        assert isinstance(offered, list)
        suite = seal.pick(self.wire, offered)
        if suite is None:
            await _refuse(conn, rid, f"no wire security in common: this server requires "
                          f"{self.wire!r}, the client accepts {', '.join(offered)}")
        assert suite is not None
        return suite

    async def _tls_version(self, conn: Connection) -> None:
        """Pin the version TLS picked by ALPN. With none picked the client predates
        negotiation (it speaks 1) or shares no version with us; if we cannot speak 1
        either, its first request is answered with an EPROTO error naming our range."""
        picked = parse_alpn(_alpn(conn.sock))
        if picked is None:
            picked = negotiate(self.versions, LEGACY_RANGE)
            if picked is None:
                # the client's first call gets the error, so it names where we are
                rid, _ = await _expect(conn, Kind.REQUEST, "a first request")
                await _refuse_version(conn, rid, self.versions, no_common(
                    self.versions, None, f"server ({_local_name(conn)})", "client",
                    " by TLS ALPN (a client from before version negotiation speaks 1)"))
        assert picked is not None
        if not self.versions[0] <= picked <= self.versions[1]:
            raise ProtocolError(f"TLS picked protocol version {picked}, outside this "
                                f"server's {fmt_range(self.versions)}")
        conn.pin_version(picked)


async def _refuse(conn: Connection, rid: int, msg: str) -> None:
    try:
        await conn.send_frame(Kind.ERROR, rid, {"errno": errno.EACCES, "msg": msg})
    except OSError:
        pass
    raise AuthError(msg)


async def _refuse_version(conn: Connection, rid: int, ours: Range, msg: str) -> None:
    """Tell the peer we share no protocol version (with our range), then give up."""
    try:
        await conn.send_frame(Kind.ERROR, rid, {"errno": errno.EPROTO, "msg": msg,
                                                "v": list(ours)})
    except OSError:
        pass
    raise VersionError(msg)


@dataclass
class ClientAuth:
    """How this process proves itself: a named key, TLS, or nothing (open clusters)."""

    name: str = ""
    key: bytes | None = None
    tls: ssl.SSLContext | None = None
    data_key: bytes | None = None  # what it proves to data servers
    versions: Range = SUPPORTED  # what the TLS context offers by ALPN must match
    wire: str = "mac"  # wire_security: what frames after a key handshake must be

    @property
    def mode(self) -> str:
        return "tls" if self.tls is not None else "key" if self.key is not None else "open"

    def for_data(self) -> ClientAuth:
        """The credentials to present to data servers."""
        if self.key is None or self.data_key is None:
            return self
        return replace(self, key=self.data_key, data_key=None)

    def _check_tls_peer(self, sock: Any, peer_cert: dict[str, Any] | None, peer: str) -> int:
        """Check the server's certificate; the protocol version TLS picked by ALPN."""
        ident = cert_identity(peer_cert)
        if ident.role != "server":
            raise AuthError(f"{peer} presented a {ident.role} certificate, not a server's")
        picked = parse_alpn(_alpn(sock))
        if picked is None:  # a server from before negotiation (1), or none in common
            version = negotiate(self.versions, LEGACY_RANGE)
            if version is None:
                raise VersionError(f"{peer}: " + no_common(
                    self.versions, None, "client", "server", " by TLS ALPN (a server from "
                    "before version negotiation speaks 1)"))
            return version
        return self._check_picked(picked, peer)

    def _check_picked(self, picked: object, peer: str) -> int:
        if type(picked) is not int or not self.versions[0] <= picked <= self.versions[1]:
            raise ProtocolError(f"{peer} picked protocol version {picked!r}, outside this "
                                f"client's {fmt_range(self.versions)}")
        return picked

    # The key handshake as steps without I/O, driven by ``hello`` (trio) and
    # ``hello_blocking`` (a blocking socket): auth request, server proof, our proof.
    def _key_request(self) -> tuple[bytes, dict[str, Any]]:
        nc = os.urandom(NONCE_BYTES)
        return nc, {"m": "auth", "v": list(self.versions), "key": self.name, "nonce": nc,
                    "s": seal.offer(self.wire)}

    def _key_suite(self, fields: dict[str, Any], peer: str) -> str:
        """The wire-security suite the server picked in its auth reply. A server from
        before wire security names none: plain frames, if this client allows them."""
        suite = fields.get("s")
        if suite is None:
            if self.wire != "none":
                raise VersionError(
                    f"{peer} does not authenticate frames after the handshake (a pfs from "
                    f"before wire security) and this client requires it (wire_security = "
                    f"{self.wire!r}): upgrade the server, or set wire_security = \"none\" "
                    "in this client's config")
            return seal.PLAIN
        if suite not in seal.offer(self.wire):
            raise ProtocolError(f"{peer} picked wire security {suite!r}, which this client "
                                f"did not offer ({', '.join(seal.offer(self.wire))})")
        return str(suite)

    def _key_session(self, key: bytes, nc: bytes, fields: dict[str, Any], version: int,
                     suite: str, peer: str) -> seal.Session:
        ns = fields["nonce"]  # checked by _key_proof
        return _session(suite, key, nc, ns, _transcript(
            self.name, seal.offer(self.wire), list(self.versions), version, suite),
            False, peer)

    def _key_version(self, fields: dict[str, Any], peer: str) -> int:
        """The version the server picked in its auth reply. A server from before
        negotiation names none: it speaks 1."""
        if "v" in fields:
            return self._check_picked(fields["v"], peer)
        version = negotiate(self.versions, LEGACY_RANGE)
        if version is None:
            raise VersionError(f"{peer}: " + no_common(
                self.versions, LEGACY_RANGE, "client", "server",
                " (it predates version negotiation)"))
        return version

    def _key_proof(self, key: bytes, nc: bytes, fields: dict[str, Any], peer: str
                   ) -> dict[str, Any]:
        ns, proof = fields.get("nonce"), fields.get("proof")
        if (not isinstance(ns, bytes) or len(ns) != NONCE_BYTES or not isinstance(proof, bytes)
                or not hmac.compare_digest(proof, _proof(key, b"server", self.name, nc, ns))):
            # the proofs differ: almost always this client's key file is not the one
            # the cluster holds under that name (else the server is not of this cluster)
            raise AuthError(f"this client's key {self.name!r} was refused: it does not "
                            f"match the key {peer} holds under that name (a wrong key "
                            f"file, or {peer} is not a server of this cluster)")
        return {"m": "auth_proof", "proof": _proof(key, b"client", self.name, nc, ns)}

    async def hello(self, conn: Connection) -> None:
        if self.tls is not None:
            version = self._check_tls_peer(conn.sock, getattr(conn.sock, "peer_cert", None),
                                           conn.name)
            conn.pin_version(version)
            return
        if self.key is None:
            return
        with trio.fail_after(AUTH_TIMEOUT):
            nc, request = self._key_request()
            await conn.send_frame(Kind.REQUEST, 0, request)
            _, fields = _check_head(await conn.recv_head(), conn.name, Kind.REPLY,
                                    "the server's auth reply", self.versions)
            proof = self._key_proof(self.key, nc, fields, conn.name)  # the server first
            version = self._key_version(fields, conn.name)
            suite = self._key_suite(fields, conn.name)
            await conn.send_frame(Kind.REQUEST, 0, proof)
            await _expect(conn, Kind.REPLY, "the server's auth verdict")
            conn.pin_version(version)
            if suite != seal.PLAIN:
                conn.install(self._key_session(self.key, nc, fields, version, suite,
                                               conn.name))

    def hello_blocking(self, conn: BlockingConnection) -> None:
        """``hello`` over a blocking connection (its timeout bounds each step)."""
        if self.tls is not None:
            version = self._check_tls_peer(conn.sock, conn.peer_cert, conn.name)
            conn.pin_version(version)
            return
        if self.key is None:
            return
        nc, request = self._key_request()
        conn.send_frame(Kind.REQUEST, 0, request)
        _, fields = _check_head(conn.recv_head(), conn.name, Kind.REPLY,
                                "the server's auth reply", self.versions)
        proof = self._key_proof(self.key, nc, fields, conn.name)
        version = self._key_version(fields, conn.name)
        suite = self._key_suite(fields, conn.name)
        conn.send_frame(Kind.REQUEST, 0, proof)
        _check_head(conn.recv_head(), conn.name, Kind.REPLY, "the server's auth verdict")
        conn.pin_version(version)
        if suite != seal.PLAIN:
            conn.install(self._key_session(self.key, nc, fields, version, suite, conn.name))


def client_auth(key_file: str = "", key_name: str = "", tls_cert: str = "", tls_key: str = "",
                tls_ca: str = "", wire: str = "mac") -> ClientAuth:
    """Credentials from config values (a client's, or a server's own as a client);
    ``wire`` (``wire_security``) is checked but not logged (the caller says it once)."""
    if wire not in seal.LEVELS:
        raise ConfigError(f"wire_security {wire!r}: want one of {', '.join(seal.LEVELS)}")
    if tls_cert or tls_key or tls_ca:
        if not (tls_cert and tls_key and tls_ca):
            raise ConfigError("TLS needs tls_cert, tls_key and tls_ca together")
        return ClientAuth(tls=client_tls(tls_cert, tls_key, tls_ca))
    if key_file:
        key = read_secret_file(key_file)
        name = key_name or CLUSTER
        return ClientAuth(name, key, None, key if name == CLUSTER else data_plane_key(key),
                          wire=wire)
    return ClientAuth()


def server_tls_from(cert: str, key: str, ca: str) -> ssl.SSLContext | None:
    if not (cert or key or ca):
        return None
    if not (cert and key and ca):
        raise ConfigError("TLS needs tls_cert, tls_key and tls_ca together")
    return server_tls(cert, key, ca)
