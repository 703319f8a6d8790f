"""The metaserver's parts on their own, without processes or sockets: security set-up,
the data-server registry, open handles and orphans, the commit queue."""
from __future__ import annotations

from pathlib import Path

import pytest

from metaserver.registry import Registry
from metaserver.security import SERVER_METHODS, cap_signer, meta_security
from pfs import auth
from pfs.config import ConfigError, MetaConfig, NodeKey


# ---------------------------------------------------------------------- security
def test_security_from_keys(tmp_path: Path) -> None:
    cluster, node = tmp_path / "cluster.key", tmp_path / "node.key"
    auth.create_key(cluster)
    auth.create_key(node)
    sec = meta_security(MetaConfig(key_file=str(cluster),
                                   node_keys=[NodeKey("n1", str(node), [10, 20], [30, 40])]))
    assert sec.server.mode == "key" and sec.own.mode == "key"
    ident = sec.server.keys["n1"][1]
    assert (ident.role, ident.uids, ident.gids) == ("client", (10, 20), (30, 40))
    assert sec.server.keys[auth.CLUSTER][1].role == "server"
    assert sec.data_keys == {"n1": auth.data_plane_key(auth.read_secret_file(node))}


def test_security_refusals_and_open_mode(tmp_path: Path) -> None:
    node = tmp_path / "node.key"
    auth.create_key(node)
    with pytest.raises(ConfigError, match="need key_file"):
        meta_security(MetaConfig(node_keys=[NodeKey("n1", str(node))]))
    sec = meta_security(MetaConfig())
    assert sec.server.mode == "open" and sec.data_keys == {}
    assert "register" in SERVER_METHODS and "create" not in SERVER_METHODS


def test_cap_signer_key_survives_a_restart(tmp_path: Path) -> None:
    cfg = MetaConfig(db=str(tmp_path))
    first = cap_signer(cfg, persistent=True)
    assert cap_signer(cfg, persistent=True).public_bytes == first.public_bytes
    assert cap_signer(cfg, persistent=False).public_bytes != first.public_bytes


# ---------------------------------------------------------------------- registry
class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_registry_liveness_follows_heartbeats() -> None:
    clock = FakeClock()
    reg = Registry(15.0, clock)
    assert not reg.heartbeat("a", 100, 50)  # never registered: must register first
    reg.register("a", "h1", 1, 100, 50)
    reg.register("b", "h2", 2, 200, 150)
    assert reg.address("a") == ("h1", 1)
    assert reg.free_space() == {"a": 50, "b": 150}
    assert reg.capacity() == (300, 200)
    clock.now += 10
    assert reg.heartbeat("a", 100, 40)
    clock.now += 10  # b silent for 20 s: down
    assert reg.address("b") is None and reg.address("a") == ("h1", 1)
    assert reg.free_space() == {"a": 40}
    assert reg.capacity() == (100, 40)
    assert reg.address("nobody") is None
    reg.register("b", "h2b", 3, 200, 100)  # back, at a new address
    assert reg.address("b") == ("h2b", 3)


def test_registry_describes_stored_servers() -> None:
    clock = FakeClock()
    reg = Registry(15.0, clock)
    stored = {"a": {"host": "old", "port": 9, "total": 1, "free": 1},
              "c": {"host": "hc", "port": 7, "total": 5, "free": 4}}
    reg.register("a", "h1", 1, 100, 50)
    assert reg.describe(stored) == {
        "a": {"host": "h1", "port": 1, "total": 100, "free": 50, "alive": True},
        "c": {"host": "hc", "port": 7, "total": 5, "free": 4, "alive": False}}
    clock.now += 16
    assert reg.describe(stored)["a"]["alive"] is False
