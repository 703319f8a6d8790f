"""Authenticated (and optionally encrypted) frames after a key handshake, sans-IO.

After the key handshake (pfs/core/auth.py) both sides hold two session keys derived from
the shared key and both nonces (:func:`session_keys`), one per direction. Every later
frame carries tags; the header stays in clear (lengths frame the stream) but is
authenticated::

    header (26) | map | T_h (16) | payload | T_p (16, only when payload_len > 0)

    mac:      T_h = GCM(K, N(seq, 0), aad = header + map, plaintext = "")  (GMAC)
              T_p = GCM(K, N(seq, 1), aad = payload, plaintext = T_h)      (tag only)
    encrypt:  map + T_h     = GCM(K, N(seq, 0), aad = header, plaintext = map)
              payload + T_p = GCM(K, N(seq, 1), aad = T_h, plaintext = payload)

``seq`` is the direction's frame counter (0 for the first frame after the handshake),
never sent: the nonce ``N(seq, part)`` is ``seq`` (u64) then ``part`` (u32), so a frame
replayed, reordered, dropped or injected fails its tag, and so does one reflected back
to its sender (the other direction has another key). ``T_p`` covers ``T_h``, so a
payload cannot be moved to another header. The map is checked (or decrypted) before the
head is handed out; the payload once all of it arrived, before the caller sees it.

The payload tag in mac mode is the GCM tag of the payload as additional data with
``T_h`` as the (discarded) plaintext, so one call computes it over a contiguous payload
(``AESGCM.encrypt``) and a streaming context gives the same tag over pieces (a gathered
write, a file sent in chunks, a scattered read): GCM's tag is a function of the whole
additional data, however it was fed.
"""
from __future__ import annotations

import errno
import hmac
import struct
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import (
    AEADDecryptionContext,
    AEADEncryptionContext,
    Cipher,
    algorithms,
    modes,
)
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from pfs.core.errors import RemoteProtocolError

TAG = 16
KEY_BYTES = 16  # AES-128: GMAC speed does not depend on it, AES-GCM's does (docs/security.md)
# What a side asks for (config ``wire_security``), weakest first.
LEVELS = ("none", "mac", "encrypt")
# The suites on the wire (the handshake's "s"), by the level they give.
MAC = "aes128-gmac"
ENCRYPT = "aes128-gcm"
SUITES = {MAC: "mac", ENCRYPT: "encrypt"}
PLAIN = "none"
# Larger payloads are sealed and opened in pieces of this size (encrypt mode: the size
# of the scratch buffer a connection keeps; a file's payload up to this size is read
# into it whole; larger ones go in pieces of ``transport.FILE_CHUNK``).
CHUNK = 256 << 10

_NONCE = struct.Struct("!QI")
_HEAD, _BODY = 0, 1


class FrameAuthError(RemoteProtocolError):
    """A frame failed its tag: tampered, injected, replayed, reordered or cut. The
    connection is dropped; the local caller gets ``EBADMSG``."""

    errno = errno.EBADMSG


def offer(level: str) -> list[str]:
    """The suites a side asking for ``level`` accepts, its preference first."""
    if level == "encrypt":
        return [ENCRYPT]
    if level == "mac":
        return [MAC, ENCRYPT]
    return [MAC, ENCRYPT, PLAIN]


def pick(level: str, offered: Sequence[object]) -> str | None:
    """The server's choice among the client's ``offered`` suites: the cheapest that both
    sides allow (the client's offer says what it allows, ``level`` what the server
    asks for); None: none fits."""
    floor = LEVELS.index(level)
    for suite in (PLAIN, MAC, ENCRYPT):
        if suite in offered and LEVELS.index(SUITES.get(suite, PLAIN)) >= floor:
            return suite
    return None


def session_keys(key: bytes, nc: bytes, ns: bytes, transcript: bytes) -> tuple[bytes, bytes]:
    """(client→server, server→client) keys: HKDF-SHA256 of the shared key, salted with
    both nonces; ``transcript`` (what was negotiated) goes into the info, so a man in the
    middle who changed the negotiation leaves the two sides with different keys."""
    okm = HKDF(algorithm=hashes.SHA256(), length=2 * KEY_BYTES, salt=nc + ns,
               info=b"pfs wire keys v1\0" + transcript).derive(key)
    return okm[:KEY_BYTES], okm[KEY_BYTES:]


class _Direction:
    __slots__ = ("key", "aead", "encrypt", "seq", "frame", "head_tag")

    def __init__(self, key: bytes, encrypt: bool) -> None:
        self.key = key
        self.aead = AESGCM(key)
        self.encrypt = encrypt
        self.seq = 0  # the next frame's
        self.frame = 0  # the frame in progress (its payload's nonce)
        self.head_tag = b""  # ... and its head's tag, which its payload's tag covers

    def _cipher(self) -> Cipher[modes.GCM]:
        """A streaming context for the current frame's payload (a new one per payload:
        its cost, ~10 µs, is paid only by payloads sealed in pieces)."""
        return Cipher(algorithms.AES(self.key), modes.GCM(_NONCE.pack(self.frame, _BODY)))


class Sealer(_Direction):
    """The sending side of one direction."""

    __slots__ = ()

    def head(self, head: bytes, header_size: int) -> bytes:
        """``head`` (header + map, from ``encode_head``) as sent: map sealed, ``T_h``
        after it. Starts a frame; its payload (if any) is sealed next."""
        seq = self.frame = self.seq
        self.seq = seq + 1
        nonce = _NONCE.pack(seq, _HEAD)
        if self.encrypt:
            sealed = self.aead.encrypt(nonce, head[header_size:], head[:header_size])
            self.head_tag = sealed[-TAG:]
            return head[:header_size] + sealed
        tag = self.aead.encrypt(nonce, b"", head)
        self.head_tag = tag
        return head + tag

    def payload_tag(self, views: Sequence[memoryview]) -> bytes:
        """mac mode: ``T_p`` of the current frame's payload."""
        if len(views) == 1:
            return self.aead.encrypt(_NONCE.pack(self.frame, _BODY), self.head_tag,
                                     views[0])[TAG:]
        mac = self.mac_stream()
        for v in views:
            mac.update(v)
        return mac.tag()

    def mac_stream(self) -> PayloadMac:
        """mac mode: ``T_p`` computed over the payload fed in pieces."""
        return PayloadMac(self._cipher().encryptor(), self.head_tag)

    def encrypt_into(self, views: Sequence[memoryview], out: memoryview) -> memoryview:
        """encrypt mode, a payload of at most ``len(out) - TAG`` bytes: its ciphertext
        and ``T_p`` in ``out``."""
        n = sum(len(v) for v in views)
        data: memoryview | bytes = views[0] if len(views) == 1 else b"".join(views)
        self.aead.encrypt_into(_NONCE.pack(self.frame, _BODY), data, self.head_tag,
                               out[:n + TAG])
        return out[:n + TAG]

    def encrypt_stream(self) -> PayloadCipher:
        """encrypt mode, a larger payload: encrypted piece by piece, ``T_p`` at the end."""
        return PayloadCipher(self._cipher().encryptor(), self.head_tag)


class PayloadMac:
    """``T_p`` (mac mode) over pieces of a payload."""

    __slots__ = ("_ctx", "_head_tag")

    def __init__(self, ctx: AEADEncryptionContext, head_tag: bytes) -> None:
        self._ctx = ctx
        self._head_tag = head_tag

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._ctx.authenticate_additional_data(data)

    def tag(self) -> bytes:
        ctx = self._ctx
        ctx.update(self._head_tag)
        ctx.finalize()
        return ctx.tag


class PayloadCipher:
    """A payload encrypted (or decrypted) piece by piece, in place or into another
    buffer of the same size."""

    __slots__ = ("_ctx",)

    def __init__(self, ctx: AEADEncryptionContext, head_tag: bytes) -> None:
        self._ctx = ctx
        ctx.authenticate_additional_data(head_tag)

    def update_into(self, data: memoryview, out: memoryview) -> None:
        self._ctx.update_into(data, out)

    def tag(self) -> bytes:
        ctx = self._ctx
        ctx.finalize()
        return ctx.tag


class Opener(_Direction):
    """The receiving side of one direction; every failure raises :class:`FrameAuthError`
    (the connection cannot be trusted any more)."""

    __slots__ = ("peer",)

    def __init__(self, key: bytes, encrypt: bool, peer: str = "peer") -> None:
        super().__init__(key, encrypt)
        self.peer = peer

    def fail(self, what: str) -> FrameAuthError:
        return FrameAuthError(
            f"{what} from {self.peer} failed authentication (frame {self.frame} of this "
            "connection tampered with, injected, replayed or reordered); connection dropped")

    def head(self, sealed: bytes, header_size: int) -> bytes:
        """The map of a frame whose ``sealed`` bytes are header, sealed map and ``T_h``."""
        seq = self.frame = self.seq
        self.seq = seq + 1
        nonce = _NONCE.pack(seq, _HEAD)
        tag = sealed[-TAG:]
        self.head_tag = tag
        if self.encrypt:
            try:
                return self.aead.decrypt(nonce, sealed[header_size:], sealed[:header_size])
            except InvalidTag:
                raise self.fail("a frame header") from None
        if not hmac.compare_digest(self.aead.encrypt(nonce, b"", sealed[:-TAG]), tag):
            raise self.fail("a frame header")
        return sealed[header_size:-TAG]

    def check_payload(self, views: Sequence[memoryview], tag: bytes) -> None:
        """Verify (mac) or decrypt in place and verify (encrypt) the current frame's
        payload, received whole into ``views``."""
        if len(views) == 1 and not self.encrypt:
            got = self.aead.encrypt(_NONCE.pack(self.frame, _BODY), self.head_tag,
                                    views[0])[TAG:]
            if not hmac.compare_digest(got, tag):
                raise self.fail("a frame payload")
            return
        check = self.stream()
        for v in views:
            check.update(v)
        check.finish(tag)

    def stream(self) -> PayloadCheck:
        """The current frame's payload checked piece by piece as it arrives."""
        return PayloadCheck(self)

    def open_payload_into(self, sealed: memoryview, dest: memoryview) -> None:
        """The current frame's whole payload and ``T_p`` (``sealed``, e.g. still in the
        decoder's buffer) checked (and decrypted) into ``dest``, in one call."""
        nonce = _NONCE.pack(self.frame, _BODY)
        if self.encrypt:
            try:
                self.aead.decrypt_into(nonce, sealed, self.head_tag, dest)
            except InvalidTag:
                raise self.fail("a frame payload") from None
            return
        body = sealed[:-TAG]
        if not hmac.compare_digest(self.aead.encrypt(nonce, self.head_tag, body)[TAG:],
                                   sealed[-TAG:]):
            raise self.fail("a frame payload")
        dest[:] = body


class PayloadCheck:
    """A payload checked (encrypt mode: decrypted in place) piece by piece."""

    __slots__ = ("_opener", "_ctx")

    def __init__(self, opener: Opener) -> None:
        self._opener = opener
        cipher = opener._cipher()
        self._ctx: AEADEncryptionContext | AEADDecryptionContext
        if opener.encrypt:
            self._ctx = cipher.decryptor()
            self._ctx.authenticate_additional_data(opener.head_tag)
        else:
            self._ctx = cipher.encryptor()  # the tag is computed, then compared

    def update(self, view: memoryview) -> None:
        if self._opener.encrypt:
            self._ctx.update_into(view, view)
        else:
            self._ctx.authenticate_additional_data(view)

    def finish(self, tag: bytes) -> None:
        """Raises ``FrameAuthError`` unless ``tag`` is the payload's."""
        ctx = self._ctx
        if isinstance(ctx, AEADDecryptionContext):  # encrypt mode
            try:
                ctx.finalize_with_tag(tag)
            except InvalidTag:
                raise self._opener.fail("a frame payload") from None
            return
        ctx.update(self._opener.head_tag)
        ctx.finalize()
        if not hmac.compare_digest(ctx.tag, tag):
            raise self._opener.fail("a frame payload")


class Session:
    """Both directions of one connection, from this side's point of view."""

    __slots__ = ("suite", "sealer", "opener")

    def __init__(self, suite: str, send_key: bytes, recv_key: bytes, peer: str) -> None:
        encrypt = SUITES[suite] == "encrypt"
        self.suite = suite
        self.sealer = Sealer(send_key, encrypt)
        self.opener = Opener(recv_key, encrypt, peer)

