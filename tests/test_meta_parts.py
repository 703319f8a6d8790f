"""The metaserver's parts on their own, without processes or sockets: security set-up,
the data-server registry, open handles and orphans, the commit queue."""
from __future__ import annotations

from pathlib import Path

import pytest

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
