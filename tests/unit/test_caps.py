"""Capabilities without a server (pfs/core/caps.py): what a data server's check refuses,
and version 1 capabilities (an older metaserver's)."""
from __future__ import annotations

import errno
import time

import msgpack
import pytest

from pfs.core import caps
from pfs.core.auth import OPEN, Identity

ALICE = Identity("alice", "client")
BOB = Identity("bob", "client")
SERVER = Identity("cluster", "server")


def refused(cap: caps.Capability, *args: object, code: int = errno.EACCES) -> str:
    with pytest.raises(OSError) as info:
        cap.check(*args)  # type: ignore[arg-type]
    assert info.value.errno == code, info.value
    return str(info.value)


def test_the_check_names_what_is_wrong() -> None:
    signer = caps.CapSigner.generate()
    v = caps.CapVerifier(signer.public_bytes)
    raw, _ = signer.issue(5, caps.READ | caps.WRITE, who="alice", max_off=1 << 20,
                          placement=caps.placement_of({"servers": [["s1", "s2"], ["s3"]]}))
    cap = v.verify(raw)
    assert cap.stripes == frozenset({0, 1}) and cap.covers(5, 1) and not cap.covers(5, 2)
    cap.check("write", caps.WRITE, (5, 0), "s2", ALICE, 1 << 20)
    cap.check("read", caps.READ, (5, 1), "s3", ALICE)
    assert "stripe 2 is outside the file's layout" in refused(
        cap, "write", caps.WRITE, (5, 2), "s3", ALICE)
    assert "not placed on data server s3" in refused(cap, "write", caps.WRITE, (5, 0), "s3",
                                                     ALICE)
    assert "issued to 'alice', presented on a connection of 'bob'" in refused(
        cap, "read", caps.READ, (5, 0), "s1", BOB)
    assert "of nobody" in refused(cap, "read", caps.READ, (5, 0), "s1", None)
    # a data server forwarding a write along the stripe's chain carries the client's on
    cap.check("write", caps.WRITE, (5, 0), "s2", SERVER, 10)
    assert "not placed" in refused(cap, "write", caps.WRITE, (5, 1), "s2", SERVER)
    assert "beyond the file's limit" in refused(cap, "write", caps.WRITE, (5, 0), "s1", ALICE,
                                                (1 << 20) + 1, code=errno.EFBIG)
    assert "for inode 5" in refused(cap, "read", caps.READ, (6, 0), "s1", ALICE)
    assert "does not allow delete" in refused(cap, "delete", caps.ADMIN, (5, 0), "s1", ALICE)


def test_the_metaservers_own_capabilities_need_the_server_role() -> None:
    signer = caps.CapSigner.generate()
    cap = caps.CapVerifier(signer.public_bytes).verify(signer.issue(5, caps.ADMIN, sid="s1")[0])
    cap.check("truncate", caps.ADMIN, (5, 3), "s1", SERVER, 1 << 50)
    cap.check("truncate", caps.ADMIN, (5, 3), "s1", OPEN)  # an unsecured server's peers
    assert "presented by a client" in refused(cap, "truncate", caps.ADMIN, (5, 3), "s1", ALICE)
    assert "another data server" in refused(cap, "truncate", caps.ADMIN, (5, 3), "s2", SERVER)


def test_a_large_layout_fits() -> None:
    signer = caps.CapSigner.generate()
    layout = {"servers": [[f"{i % 64:032x}", f"{(i + 1) % 64:032x}"] for i in range(256)]}
    raw, _ = signer.issue(9, caps.READ, who="alice", placement=caps.placement_of(layout))
    assert len(raw) <= caps.MAX_CAP
    cap = caps.CapVerifier(signer.public_bytes).verify(raw)
    cap.check("read", caps.READ, (9, 255), f"{0:032x}", ALICE)


def test_a_files_capability_is_the_same_body_with_its_encoding_kept() -> None:
    """``issue_file`` (what open and create sign) encodes what ``issue`` does; the part
    it keeps per layout and identity is not shared between identities or limits."""
    signer = caps.CapSigner.generate()
    v = caps.CapVerifier(signer.public_bytes)
    layout = {"servers": [["s1", "s2"], ["s3", "s1"], ["s2"]]}
    full = msgpack.unpackb(signer.issue(7, caps.WRITE, who="alice", max_off=1 << 30,
                                        placement=caps.placement_of(layout))[0][:-64])
    for who, max_off in (("alice", 1 << 30), ("alice", 1 << 30), ("bob", 1 << 30),
                         ("alice", 1 << 20)):
        raw, ttl = signer.issue_file(7, caps.WRITE, who, caps.stripes_of(layout), max_off)
        body = msgpack.unpackb(raw[:-64])
        assert ttl == signer.ttl and body[4] > full[4]  # a later generation
        assert body[:4] == full[:4] and body[7:] == full[7:]
        assert body[5:7] == [who, max_off]
        cap = v.verify(raw)
        assert cap.who == who and cap.max_off == max_off and cap.covers(7, 2)
        cap.check("write", caps.WRITE, (7, 1), "s1", Identity(who, "client"))
    assert caps.placement_of(layout) == {0: ("s1", "s2"), 1: ("s3", "s1"), 2: ("s2",)}
    assert caps.stripes_of(None) == () and caps.placement_of({}) == {}


def _v1(signer: caps.CapSigner, body: list[object]) -> bytes:
    raw = msgpack.packb(body, use_bin_type=True)
    return raw + signer._key.sign(raw)


def test_version_1_is_refused_unless_the_metaserver_is_older() -> None:
    signer = caps.CapSigner.generate()
    old = _v1(signer, [1, 5, None, caps.READ | caps.WRITE, int(time.time()) + 60, 1, ""])
    with pytest.raises(OSError) as info:
        caps.CapVerifier(signer.public_bytes).verify(old)
    assert info.value.errno == errno.EACCES and "version 1" in str(info.value)
    cap = caps.CapVerifier(signer.public_bytes, legacy=True).verify(old)
    cap.check("write", caps.WRITE, (5, 7), "any", BOB, 1 << 45)  # what version 1 allowed
    bound = _v1(signer, [1, 5, [0], caps.ADMIN, int(time.time()) + 60, 1, "s1"])
    cap = caps.CapVerifier(signer.public_bytes, legacy=True).verify(bound)
    assert "outside" in refused(cap, "truncate", caps.ADMIN, (5, 1), "s1", SERVER)
    assert "not placed" in refused(cap, "truncate", caps.ADMIN, (5, 0), "s2", SERVER)


def test_malformed_placements_are_refused() -> None:
    signer = caps.CapSigner.generate()
    v = caps.CapVerifier(signer.public_bytes)
    now = int(time.time()) + 60
    bad: list[object] = [[[0, 5]], [[-1, 0]], [[]], ["x"], 7]
    for placement in bad:
        raw = _v1(signer, [2, 5, caps.READ, now, 1, "a", 10, ["s1"], placement])
        with pytest.raises(OSError) as info:
            v.verify(raw)
        assert info.value.errno == errno.EACCES and "malformed" in str(info.value)
