"""Who the metaserver trusts and how it proves itself: from the config, the way peers
authenticate to it, the way it authenticates to data servers, the data-plane keys it
hands to registered data servers, the capability signer, and which methods a data
server's credentials reach (docs/security.md)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from pfs.core import auth, caps
from pfs.core.auth import ClientAuth, ServerAuth
from pfs.core.config import ConfigError, MetaConfig

log = logging.getLogger(__name__)

# Methods a peer with the "server" role (a data server) may call; every other one
# needs a client (or, on an unsecured cluster, anyone).
SERVER_METHODS = frozenset({"hello", "register", "heartbeat", "servers", "statfs",
                            "chain_drop", "get_chain"})


@dataclass(frozen=True, slots=True)
class MetaSecurity:
    server: ServerAuth  # how peers authenticate to the metaserver
    own: ClientAuth  # how the metaserver authenticates to data servers
    data_keys: dict[str, bytes]  # node name -> data-plane key, for registered data servers
    # client keys made without ``allow_root``: uid 0 of their holders is squashed
    no_root: frozenset[str] = frozenset()


def meta_security(config: MetaConfig) -> MetaSecurity:
    """The config's keys and certificates, read and checked (key files 0600)."""
    tls = auth.server_tls_from(config.tls_cert, config.tls_key, config.tls_ca)
    keys: dict[str, tuple[bytes, auth.Identity]] = {}
    data_keys: dict[str, bytes] = {}
    if config.key_file:
        keys[auth.CLUSTER] = (auth.read_secret_file(config.key_file),
                              auth.Identity(auth.CLUSTER, "server"))
    elif config.node_keys and tls is None:
        raise ConfigError("node_keys need key_file (the cluster key) as well")
    for nk in config.node_keys:
        k = auth.read_secret_file(nk.file)
        keys[nk.name] = (k, auth.Identity(nk.name, "client", (nk.uids[0], nk.uids[1]),
                                          (nk.gids[0], nk.gids[1])))
        data_keys[nk.name] = auth.data_plane_key(k)
    if tls is not None:
        own = auth.client_auth(tls_cert=config.tls_cert, tls_key=config.tls_key,
                               tls_ca=config.tls_ca)
        return MetaSecurity(ServerAuth(tls=tls), own, {})
    wire = auth.check_wire(config.wire_security, "metaserver") if keys else "mac"
    own = auth.client_auth(key_file=config.key_file, wire=wire)
    no_root = frozenset(nk.name for nk in config.node_keys if not nk.allow_root)
    return MetaSecurity(ServerAuth(keys=keys, wire=wire), own, data_keys, no_root)


def cap_signer(config: MetaConfig, *, persistent: bool) -> caps.CapSigner:
    """The capability signer: its key kept in the db directory (so capabilities stay
    valid across a restart), or a fresh one for a store that lives in memory."""
    if persistent:
        return caps.CapSigner.load_or_create(os.path.join(config.db, caps.KEY_FILE),
                                             config.cap_ttl)
    return caps.CapSigner.generate(config.cap_ttl)


def keep_private(db: str) -> None:
    """The store's directory 0700 and its files 0600: the namespace is the service's
    alone (servers run with umask 077, docs/security.md; this fixes stores made before)."""
    try:
        os.chmod(db, 0o700)
        for name in os.listdir(db):
            path = os.path.join(db, name)
            if os.path.isfile(path) and os.stat(path).st_mode & 0o077:
                os.chmod(path, 0o600)
    except OSError as exc:  # not ours to change (a read-only mount...): say so, go on
        log.warning("could not make the metadata store %s private: %s", db, exc)
