"""Typed configuration in TOML. Unknown keys are an error, so a typo never passes
silently as a default."""
from __future__ import annotations

import dataclasses
import errno
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pfs.core import logs

T = TypeVar("T")

# What frames after a key handshake must be (docs/security.md "Wire security"): "mac"
# (authenticated, the default), "encrypt" (authenticated and encrypted), "none" (plain
# unless the peer asks; only when a config says so). Same order as pfs.core.wire.seal.
WIRE_SECURITY = ("none", "mac", "encrypt")


def check_wire_security(value: str) -> None:
    if value not in WIRE_SECURITY:
        raise ConfigError(f"wire_security {value!r}: want one of mac, encrypt, none")


class ConfigError(ValueError):
    pass


def check_logging(level: str, fmt: str) -> None:
    """A server's ``log_level`` and ``log_format`` (pfs/core/logs.py)."""
    if level.upper() not in logs.LEVELS:
        raise ConfigError(f"log_level {level!r}: want one of {', '.join(logs.LEVELS)}")
    if fmt not in logs.FORMATS:
        raise ConfigError(f"log_format {fmt!r}: want one of {', '.join(logs.FORMATS)}")


# -- client profiles: the data path by workload phase -------------------------------
# Thresholds (bytes per request), from the engine micro-benchmark (now `pfs bench sweep/iops`;
# page-cache reads, 2 cores): below SMALL_READ_MAX a read is latency-bound, and the cheapest
# path wins (posix inline in the event loop: p50 ~15-20 us at queue depth 1, io_uring
# ~20-28 us); from LARGE_READ_MIN up io_uring with IOSQE_ASYNC and 1 MiB SQEs moves 8-9 GB/s
# against 3-5 GB/s for preadv in threads, at half the CPU per GB. GDS_MIN_BYTES is kvikio's
# own GDS threshold: smaller GPU reads are cheaper staged through pinned host memory.
PROFILES = ("inference", "load", "auto")
SMALL_READ_MAX = 64 << 10
LARGE_READ_MIN = 1 << 20
GDS_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class ProfileSettings:
    """What a profile means for one request.

    - ``engine``: local-file engine (``posix`` or ``uring``);
    - ``queue_depth``: ops in flight per engine;
    - ``chunk``: largest single op; bigger reads are cut and run in parallel;
    - ``gds``: GPU destinations of local files go through kvikio (else pinned staging);
    - ``merge_gap``: a loader merges two tensors' byte ranges into one read when at most
      this many unwanted bytes lie between them."""

    name: str
    engine: str
    queue_depth: int
    chunk: int
    gds: bool
    merge_gap: int


def check_profile(name: str) -> str:
    if name not in PROFILES:
        raise ConfigError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}")
    return name


def profile_settings(name: str, nbytes: int | None = None) -> ProfileSettings:
    """The settings of profile ``name``; ``auto`` picks by request size ``nbytes``:
    ``inference`` up to SMALL_READ_MAX, ``load`` from LARGE_READ_MIN, and in between
    io_uring with a medium queue (unknown size: ``load``, the bulk case)."""
    check_profile(name)
    if name == "inference":
        return ProfileSettings("inference", "uring", 64, 256 << 10, False, 0)
    if name == "load":
        return ProfileSettings("load", "uring", 32, 1 << 20, True, 1 << 20)
    if nbytes is None or nbytes >= LARGE_READ_MIN:
        return dataclasses.replace(profile_settings("load"), name="auto")
    if nbytes <= SMALL_READ_MAX:
        return dataclasses.replace(profile_settings("inference"), name="auto")
    return ProfileSettings("auto", "uring", 32, 1 << 20, nbytes >= GDS_MIN_BYTES, 64 << 10)


@dataclass
class ClientConfig:
    meta: str = "127.0.0.1:9400"  # metaserver HOST:PORT
    timeout: float = 60.0  # seconds per RPC before ETIMEDOUT
    # until the metaserver has answered once, an outage is retried this long, not
    # ``timeout``: a mistyped address or a cluster that is not up fails a command soon
    connect_timeout: float = 10.0
    connections_per_server: int = 2  # data connections per data server
    uid: int = -1  # credentials sent with requests; -1: this process's
    gid: int = -1
    profile: str = "auto"  # data path by workload phase: inference, load or auto (above)
    # read objects of data servers on this host through descriptors they hand over
    # (after the capability check) instead of through TCP; falls back by itself
    short_circuit: bool = True
    # the synchronous client (pfs.connect) sends metadata calls, and small reads and
    # writes (one stripe piece, up to the profile's limit), from the calling thread on
    # blocking connections instead of through its trio thread (about 4x less client CPU
    # per call; docs/architecture.md). The async client and the FUSE mount always
    # multiplex on their event loop.
    direct_meta: bool = True
    # hedged reads (docs/architecture.md, "Failure detection"): a read of a replicated
    # stripe not answered within its server's measured deadline (srtt + 4 rttvar), kept
    # within [hedge_min, hedge_max] seconds, is sent to the next replica too; the first
    # answer wins. A server that lost a race or failed is read last for slow_penalty s.
    hedge_min: float = 0.1
    hedge_max: float = 2.0
    slow_penalty: float = 5.0
    # authentication (docs/security.md): a key file (mode 0600) and the name the
    # metaserver knows it by, or TLS files from `pfs certs`; none: an unsecured cluster
    key_file: str = ""
    key_name: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    # Prometheus /metrics of the mount, or of a program's client, on this port (0: off;
    # the `pfs` commands never serve it); client cache hits, hedges, checksum failures
    metrics_port: int = 0
    wire_security: str = "mac"  # frames after a key handshake: mac, encrypt or none

    def __post_init__(self) -> None:
        check_profile(self.profile)
        check_wire_security(self.wire_security)

    @property
    def meta_addr(self) -> tuple[str, int]:
        return parse_addr(self.meta)


@dataclass
class LayoutDefaults:
    unit: int = 1 << 20
    count: int = 4
    # two copies where the cluster has two data servers or more (placement never gives
    # a stripe more replicas than there are servers up: one on a one-server cluster)
    replicas: int = 2


@dataclass
class ConnLimits:
    """How many connections a server takes, and how long one may take to authenticate
    (docs/security.md, "Floods")."""

    max_connections: int = 4096  # at once; lowered to fit the open-file limit
    max_per_peer: int = 1024  # from one address; more are closed at once
    max_unauthenticated: int = 256  # still in their handshake; a new one evicts the oldest
    max_unauthenticated_per_peer: int = 64  # ... of them from one address
    handshake_timeout: float = 5.0  # seconds to authenticate, else the connection closes

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_per_peer", "max_unauthenticated",
                     "max_unauthenticated_per_peer"):
            if getattr(self, name) < 1:
                raise ConfigError(f"connections.{name} must be at least 1")
        if not self.handshake_timeout > 0:
            raise ConfigError("connections.handshake_timeout must be positive")


@dataclass
class NodeKey:
    """A client key the metaserver accepts, and the ids its holder may claim."""

    name: str
    file: str
    uids: list[int] = field(default_factory=lambda: [0, (1 << 32) - 1])  # [lo, hi]
    gids: list[int] = field(default_factory=lambda: [0, (1 << 32) - 1])
    # may act as uid 0; without it root on that node is squashed to the metaserver's
    # squash_uid/squash_gid (docs/security.md, "Node keys and root")
    allow_root: bool = False

    def __post_init__(self) -> None:
        for label, r in (("uids", self.uids), ("gids", self.gids)):
            if len(r) != 2 or not 0 <= r[0] <= r[1] < 1 << 32:
                raise ConfigError(f"node key {self.name!r}: {label} must be [lo, hi]")
        if not self.name or self.name == "cluster":
            raise ConfigError(f"node key name {self.name!r} is empty or reserved")


@dataclass
class MetaConfig:
    db: str = "meta.lmdb"  # LMDB directory
    host: str = "127.0.0.1"
    port: int = 9400
    map_size: int = 8 << 30  # LMDB map size in bytes
    # failure detection (docs/architecture.md, "Failure detection"): a data server's
    # heartbeat holds a lease this long; silent past it, the server is down (out of
    # placement, its space out of statfs)
    heartbeat_timeout: float = 5.0
    suspect_after: float = 2.5  # silent this long: shown suspect (still placed)
    # a client's report of a refused connection is checked with a probe (a connection and
    # a statfs) that must answer within this: refused = down at once, no answer = suspect
    probe_timeout: float = 1.0
    # a data server with less free space than this on a directory gets no new stripes:
    # reserve_bytes or reserve_percent of the filesystem, whichever is smaller
    reserve_bytes: int = 256 << 20
    reserve_percent: float = 1.0
    layout: LayoutDefaults = field(default_factory=LayoutDefaults)
    # repair (docs/architecture.md "Repair"): bytes/s a chain's head copies to a new or
    # returning member (0: unbounded); a data server down this many seconds is lost (its
    # chains get new members; 0: only `pfs admin lost` declares one)
    repair_rate: int = 100 << 20
    lost_after: float = 600.0
    repair_interval: float = 2.0  # seconds between repair passes
    # security (docs/security.md)
    key_file: str = ""  # the cluster key; with node_keys: key mode
    node_keys: list[NodeKey] = field(default_factory=list)
    tls_cert: str = ""  # TLS mode: this server's certificate, key and the CA
    tls_key: str = ""
    tls_ca: str = ""
    wire_security: str = "mac"  # frames after a key handshake: mac, encrypt or none
    root_squash: bool = False  # uid 0 of client peers becomes squash_uid/squash_gid
    squash_uid: int = 65534
    squash_gid: int = 65534
    cap_ttl: float = 300.0  # seconds a capability lives; clients renew before
    # the largest stripe object: a file of N stripes grows to N times this (capabilities
    # carry it, so a data server refuses writes past it; docs/security.md)
    max_object_size: int = 1 << 40
    connections: ConnLimits = field(default_factory=ConnLimits)
    metrics_port: int = 0  # Prometheus /metrics on this port (0: off; docs: 9401)
    # logging (docs/architecture.md "Operations"); --log-level/--log-format override
    log_level: str = "INFO"  # DEBUG, INFO, WARNING, ERROR, CRITICAL
    log_format: str = "text"  # text, or json: one JSON object per line

    def __post_init__(self) -> None:
        check_wire_security(self.wire_security)
        check_logging(self.log_level, self.log_format)


@dataclass
class KvNamespace:
    """A KV-cache namespace only the named node keys may use (the cluster key too)."""

    name: str
    keys: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("kv_namespaces: a namespace needs a name")


@dataclass
class DataConfig:
    dirs: list[str] = field(default_factory=lambda: ["data"])
    host: str = "127.0.0.1"
    port: int = 0
    meta: str = "127.0.0.1:9400"
    engine: str = "auto"  # auto (io_uring where the kernel has it, else posix), posix, uring
    heartbeat: float = 1.0  # seconds between heartbeats (each renews the lease)
    local_socket: bool = True  # serve short-circuit reads to clients on this host
    free_override: int = -1  # TEST ONLY: report this many bytes free per directory
    checksums: bool = True  # block checksums (off only to measure what they cost)
    scrub_rate: int = 4 << 20  # bytes/s the scrubber re-reads and verifies (0: off)
    # days a tombstone of an unlinked file's deleted object is kept: a metadata backup
    # older than that restored reads such files as holes again (dataserver/tombstones.py)
    tombstone_days: float = 365.0
    # failure domain (a rack label): a chain's replicas go to distinct ones; "": the host
    domain: str = ""
    # seconds a chain member waits for the next one to take a forwarded write before
    # reporting it to the metaserver (taken out of the chain; the write goes on)
    forward_timeout: float = 5.0
    key_file: str = ""  # the cluster key (docs/security.md)
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    connections: ConnLimits = field(default_factory=ConnLimits)
    metrics_port: int = 0  # Prometheus /metrics on this port (0: off; docs: 9402)
    wire_security: str = "mac"  # frames after a key handshake: mac, encrypt or none
    # logging (docs/architecture.md "Operations"); --log-level/--log-format override
    log_level: str = "INFO"  # DEBUG, INFO, WARNING, ERROR, CRITICAL
    log_format: str = "text"  # text, or json: one JSON object per line
    # KV-cache blocks (docs/architecture.md "KV-cache tier"): bytes of slabs at most;
    # -1: a tenth of the first data directory's filesystem, at most 64 GiB; 0: none
    kv_budget: int = -1
    # namespaces restricted to named node keys (any other namespace: any client)
    kv_namespaces: list[KvNamespace] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_wire_security(self.wire_security)
        check_logging(self.log_level, self.log_format)
        if self.kv_budget < -1:
            raise ConfigError(f"kv_budget {self.kv_budget}: want bytes, 0 (none) or -1 "
                              f"(a tenth of the disk)")


def parse_addr(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"address {text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, refusing unknown keys and wrong types."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(data) - names
    if unknown:
        raise ConfigError(f"unknown key(s) {sorted(unknown)} in {where or cls.__name__}"
                          f"; known: {sorted(names)}")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        hint = hints[key]
        label = f"{where}.{key}" if where else key
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"{label} must be a table")
            kwargs[key] = from_dict(hint, value, label)  # type: ignore[arg-type]
            continue
        kwargs[key] = _coerce(hint, value, label)
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, label: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{label} must be a list")
        if dataclasses.is_dataclass(item):
            if not all(isinstance(v, dict) for v in value):
                raise ConfigError(f"{label} must be a list of tables")
            return [from_dict(item, v, label) for v in value]  # type: ignore[arg-type]
        return [_coerce(item, v, label) for v in value]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{label} must be {hint.__name__}, not {type(value).__name__}")
    return value


def load(cls: type[T], path: str | os.PathLike[str]) -> T:
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None
    return from_dict(cls, data, p.name)


def dump(obj: Any) -> str:
    """TOML text for a config dataclass (flat values and one level of tables)."""
    lines: list[str] = []
    tables: list[tuple[str, Any]] = []
    arrays: list[tuple[str, Any]] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            tables.append((f.name, value))
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            arrays.extend((f.name, v) for v in value)
        else:
            lines.append(f"{f.name} = {_toml_value(value)}")
    for name, table in tables:
        lines.append(f"\n[{name}]")
        lines.extend(f"{f.name} = {_toml_value(getattr(table, f.name))}"
                     for f in dataclasses.fields(table))
    for name, table in arrays:
        lines.append(f"\n[[{name}]]")
        lines.extend(f"{f.name} = {_toml_value(getattr(table, f.name))}"
                     for f in dataclasses.fields(table))
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ConfigError(f"cannot write {v!r} as TOML")


# Where a client looks for its config when none is named (docs/security.md, "User
# keys"): $PFS_CONFIG, then the user's own, then the node's. A user's comes before the
# node's so that an ordinary user with a key of their own never needs to read the node's.
SYSTEM_CLIENT_CONFIG = "/etc/pfs/client.toml"


def user_client_config() -> Path:
    """``$XDG_CONFIG_HOME/pfs/client.toml`` (default ``~/.config/pfs/client.toml``)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"),
                                                             ".config")
    return Path(base) / "pfs" / "client.toml"


def _unusable(path: Path) -> str | None:
    """Why the client config ``path`` cannot be used by this process (None: it can):
    it is missing or unreadable, or names a key file this process cannot read."""
    try:
        os.stat(path)
        cfg = load(ClientConfig, path)
    except FileNotFoundError:
        return "does not exist"
    except PermissionError:
        return "not readable by this user (EACCES)"
    except ConfigError as exc:
        return str(exc)
    except OSError as exc:
        return f"{exc.strerror} ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
    for secret in (cfg.key_file, cfg.tls_key):
        try:
            if secret and os.stat(secret) and not os.access(secret, os.R_OK):
                return f"its key file {secret} is not readable by this user (EACCES)"
        except FileNotFoundError:
            return f"its key file {secret} does not exist"
        except PermissionError:
            return f"its key file {secret} is not reachable by this user (EACCES)"
    return None


def find_client_config() -> Path:
    """The client config of this process when none is named: ``$PFS_CONFIG`` (used as
    it is, when set), else the first usable of the user's and the node's. ConfigError
    naming every file tried, and why each was passed over."""
    env = os.environ.get("PFS_CONFIG")
    if env:
        return Path(env)
    tried: list[str] = ["$PFS_CONFIG: not set"]
    for path in (user_client_config(), Path(SYSTEM_CLIENT_CONFIG)):
        why = _unusable(path)
        if why is None:
            return path
        tried.append(f"{path}: {why}")
    raise ConfigError("no cluster given and no usable client config (pass --config FILE or "
                      "--meta HOST:PORT, or set PFS_CONFIG); tried " + "; ".join(tried)
                      + ". An ordinary user needs a key of their own: ask the "
                      "administrator for one (pfs admin key create NAME --owner USER)")


def client_config(config: Any = None, meta: str | None = None) -> ClientConfig:
    """Resolve a client configuration: explicit object or path, ``--meta`` alone (an
    open client), or :func:`find_client_config`."""
    if isinstance(config, ClientConfig):
        cfg = config
    elif config is not None:
        cfg = load(ClientConfig, config)
    elif meta is None or os.environ.get("PFS_CONFIG"):
        cfg = load(ClientConfig, find_client_config())
    else:  # --meta alone: an open client, as before the lookup (unless $PFS_CONFIG)
        cfg = ClientConfig()
    if meta is not None:
        parse_addr(meta)
        cfg = dataclasses.replace(cfg, meta=meta)
    return cfg
