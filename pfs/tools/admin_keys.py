"""``pfs admin key create/list/revoke``: the node keys of a metaserver's config.

The metaserver's config (``meta.toml``, or ``--cluster DIR`` for DIR/meta.toml of a
``pfs cluster``) is the list of node keys: each ``[[node_keys]]`` entry names a key file
(32 random bytes, mode 0600), the uid and gid ranges its holder may claim, and whether it
may act as root (``allow_root``; without it, uid 0 on that node is squashed to the
metaserver's ``squash_uid``). ``create`` writes the key file and adds the entry,
``revoke`` removes both; the metaserver reads the list when it starts, so restart it
(``pfs cluster down DIR && pfs cluster up DIR``, or the service) to apply either; data
servers learn the change when they register again, which they do by themselves once the
metaserver is back (docs/security.md, "Node keys and root").

``create NAME --owner USER`` issues a *user key* (docs/security.md, "User keys"): the
user's uid and gid only, never root, with the user's own copy and a client config
written where the client looks (``~USER/.config/pfs``) by a process that has become
the user.
"""
from __future__ import annotations

import argparse
import os
import pwd
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from pfs.core import config as cfgmod
from pfs.core.config import ConfigError, MetaConfig, NodeKey
from pfs.tools.output import print_json

FULL = (0, (1 << 32) - 1)

RESTART = "restart the metaserver to apply it (data servers follow when they re-register)"


def _config_path(config: str | None, cluster: str | None) -> Path:
    if cluster:
        return Path(cluster) / "meta.toml"
    if config:
        return Path(config)
    raise ConfigError("name the metaserver's config: --config META_TOML or --cluster DIR")


def _load(path: Path) -> MetaConfig:
    if not path.exists():
        raise ConfigError(f"{path} does not exist")
    return cfgmod.load(MetaConfig, path)


def _save(path: Path, cfg: MetaConfig) -> None:
    """Write the config back (0600: it names every key file), atomically."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(cfgmod.dump(cfg))
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def key_dir(path: Path, cfg: MetaConfig) -> Path:
    """Where new key files go: beside the cluster key, else ``keys/`` beside the config."""
    if cfg.key_file:
        return Path(cfg.key_file).parent
    return path.parent / "keys"


def create(path: Path, name: str, uids: tuple[int, int] = FULL,
           gids: tuple[int, int] = FULL, allow_root: bool = False,
           directory: Path | None = None) -> NodeKey:
    """A new node key ``name``: its file (mode 0600) and its entry in the config."""
    cfg = _load(path)
    return _create(path, cfg, name, uids, gids, allow_root, directory)


def _create(path: Path, cfg: MetaConfig, name: str, uids: tuple[int, int],
            gids: tuple[int, int], allow_root: bool, directory: Path | None) -> NodeKey:
    if any(nk.name == name for nk in cfg.node_keys):
        raise ConfigError(f"{path} already has a node key {name!r}; revoke it first")
    d = directory or key_dir(path, cfg)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    key_file = (d / f"{name}.key").resolve()
    nk = NodeKey(name, str(key_file), list(uids), list(gids), allow_root)  # checks the name
    from pfs.core.auth import create_key  # not at the top: `pfs` starts without trio

    if not create_key(key_file):
        raise ConfigError(f"{key_file} exists already; remove it or pick another name")
    cfg.node_keys.append(nk)
    _save(path, cfg)
    return nk


@dataclass(frozen=True)
class UserKey:
    """A key issued to one user: the metaserver's entry and the user's own copy."""

    key: NodeKey
    user: str
    key_file: Path  # the user's copy (mode 0600, owned by the user)
    config: Path  # the user's client config (this command's, or one that was there)
    config_written: bool


def owner_of(text: str) -> pwd.struct_passwd:
    """``--owner``: a user name or a numeric uid, from the password database."""
    try:
        return pwd.getpwuid(int(text)) if text.isdigit() else pwd.getpwnam(text)
    except KeyError:
        raise ConfigError(f"no user {text!r} on this host (--owner takes a user name or "
                          "uid known to the password database)") from None


def meta_address(cfg: MetaConfig) -> str:
    """What a client on another host dials: the config's address, or this host's name
    when it listens on every address."""
    host = cfg.host if cfg.host not in ("", "0.0.0.0", "::") else socket.getfqdn()
    return f"[{host}]:{cfg.port}" if ":" in host else f"{host}:{cfg.port}"


def create_for_user(path: Path, name: str, owner: str, uids: tuple[int, int] | None = None,
                    gids: tuple[int, int] | None = None, directory: Path | None = None,
                    user_dir: Path | None = None, meta: str | None = None) -> UserKey:
    """A user key (docs/security.md, "User keys"): a node key limited to ``owner``'s
    uid and gid (unless ``uids``/``gids`` say otherwise), never root, whose copy for the
    user goes to ``user_dir`` (default ``~owner/.config/pfs``) with a client config
    naming it, both written by a process running as the user (so nothing the user
    controls there can redirect a write of root's), mode 0600. The metaserver keeps its
    own copy in the key directory: a user cannot delete or swap what it needs to start."""
    pw = owner_of(owner)
    if pw.pw_uid == 0:
        raise ConfigError("a user key is for an ordinary user; root's key is an admin key "
                          "(pfs admin key create NAME --allow-root)")
    if os.geteuid() not in (0, pw.pw_uid):
        raise ConfigError(f"only root can issue a key to user {pw.pw_name!r}")
    cfg = _load(path)
    dest = user_dir or Path(pw.pw_dir) / ".config" / "pfs"
    nk = _create(path, cfg, name, uids or (pw.pw_uid, pw.pw_uid),
                 gids or (pw.pw_gid, pw.pw_gid), False, directory)
    secret = Path(nk.file).read_bytes()
    key_file = dest / f"{name}.key"
    config = dest / "client.toml"
    text = (f"# pfs client config of {pw.pw_name}: `pfs admin key create {name} --owner "
            f"{pw.pw_name}`\nmeta = \"{meta or meta_address(cfg)}\"\nkey_file = \"{key_file}\"\n"
            f"key_name = \"{name}\"\n"
            "# the ids the key allows, sent as they are: the user's supplementary groups,\n"
            "# which the key does not vouch for, are not sent (they would be EPERM)\n"
            f"uid = {pw.pw_uid}\ngid = {pw.pw_gid}\n")
    try:
        written = _write_as(pw, dest, key_file, secret, config, text)
    except ConfigError:
        revoke(path, name)  # no half-issued key: the entry goes with the failed copy
        raise
    return UserKey(nk, pw.pw_name, key_file, config, written)


def _write_as(pw: pwd.struct_passwd, dest: Path, key_file: Path, secret: bytes,
              config: Path, text: str) -> bool:
    """Write the user's key and (if absent) client config in a child that has become
    the user; True when the config was written. ConfigError with the child's reason."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the user's rights only, then plain file operations
        os.close(rfd)
        code = 0
        try:
            if os.geteuid() != pw.pw_uid:
                os.setgroups([])
                os.setgid(pw.pw_gid)
                os.setuid(pw.pw_uid)
            os.umask(0o077)
            dest.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                         0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secret)
            try:
                fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                             0o600)
            except FileExistsError:
                code = 3
            else:
                with os.fdopen(fd, "w") as f:
                    f.write(text)
        except OSError as exc:
            os.write(wfd, f"{exc.filename or dest}: {exc.strerror}".encode())
            code = 1
        os._exit(code)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as r:
        why = r.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 3):
        raise ConfigError(f"could not write the key of user {pw.pw_name!r}: "
                          f"{why or f'exit status {code}'}")
    return code == 0


def revoke(path: Path, name: str) -> NodeKey:
    """Remove node key ``name`` from the config and delete its file."""
    cfg = _load(path)
    found = [nk for nk in cfg.node_keys if nk.name == name]
    if not found:
        raise ConfigError(f"{path} has no node key {name!r}")
    cfg.node_keys = [nk for nk in cfg.node_keys if nk.name != name]
    _save(path, cfg)
    Path(found[0].file).unlink(missing_ok=True)
    return found[0]


def listing(path: Path) -> list[NodeKey]:
    return list(_load(path).node_keys)


def describe(nk: NodeKey, squash_uid: int) -> str:
    root = "yes" if nk.allow_root else f"no (squashed to uid {squash_uid})"
    present = "" if Path(nk.file).exists() else "  (key file missing)"
    return (f"{nk.name}\tuids {nk.uids[0]}-{nk.uids[1]}\tgids {nk.gids[0]}-{nk.gids[1]}"
            f"\troot: {root}\t{nk.file}{present}")


def record(nk: NodeKey, squash_uid: int) -> dict[str, object]:
    """What ``pfs admin key list --json`` prints of one key."""
    return {"name": nk.name, "file": nk.file, "uids": list(nk.uids), "gids": list(nk.gids),
            "allow_root": nk.allow_root, "squash_uid": None if nk.allow_root else squash_uid,
            "file_present": Path(nk.file).exists()}


def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi if sep else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad id range {text!r}: want LO-HI") from None
    if not 0 <= a <= b <= FULL[1]:
        raise argparse.ArgumentTypeError(f"bad id range {text!r}")
    return a, b


def cmd_key(args: argparse.Namespace) -> None:
    try:
        path = _config_path(args.config, args.cluster)
        if args.keycmd == "create" and args.owner:
            _cmd_create_user(path, args)
        elif args.keycmd == "create":
            nk = create(path, args.name, args.uids or FULL, args.gids or FULL, args.allow_root,
                        Path(args.key_dir) if args.key_dir else None)
            print(f"created node key {nk.name!r}: {nk.file} (mode 0600); uids "
                  f"{nk.uids[0]}-{nk.uids[1]}, gids {nk.gids[0]}-{nk.gids[1]}, "
                  f"{'may act as root' if nk.allow_root else 'root squashed'}")
            print(f"a client uses it with: key_file = \"{nk.file}\"  key_name = "
                  f"\"{nk.name}\"; {RESTART}")
        elif args.keycmd == "revoke":
            nk = revoke(path, args.name)
            print(f"revoked node key {nk.name!r} (deleted {nk.file}); {RESTART}")
        else:
            cfg = _load(path)
            if args.json:
                print_json([record(nk, cfg.squash_uid) for nk in cfg.node_keys])
                return
            for nk in cfg.node_keys:
                print(describe(nk, cfg.squash_uid))
    except ConfigError as exc:
        raise SystemExit(f"pfs admin key: {exc}") from None


def _cluster_meta(cluster: str | None) -> str | None:
    """The metaserver address of a ``pfs cluster`` (its client.toml has the real port)."""
    toml = Path(cluster) / "client.toml" if cluster else None
    if toml is None or not toml.exists():
        return None
    return cfgmod.load(cfgmod.ClientConfig, toml).meta


def _cmd_create_user(path: Path, args: argparse.Namespace) -> None:
    if args.allow_root:
        raise ConfigError("a user key never acts as root: drop --allow-root or --owner")
    uk = create_for_user(path, args.name, args.owner, args.uids, args.gids,
                         Path(args.key_dir) if args.key_dir else None,
                         Path(args.user_dir) if args.user_dir else None,
                         _cluster_meta(args.cluster))
    nk = uk.key
    print(f"created user key {nk.name!r} for {uk.user}: uids {nk.uids[0]}-{nk.uids[1]}, "
          f"gids {nk.gids[0]}-{nk.gids[1]}, root squashed; the metaserver's copy {nk.file}")
    print(f"{uk.user}'s copy: {uk.key_file} (mode 0600, owned by {uk.user})")
    if uk.config_written:
        print(f"{uk.user}'s client config: {uk.config}")
    else:
        print(f"{uk.config} exists and was left alone: set key_file = \"{uk.key_file}\" "
              f"and key_name = \"{nk.name}\" in it", file=sys.stderr)
    print(f"on other client hosts, install both files in {uk.user}'s ~/.config/pfs/ "
          f"(mode 0600, owned by {uk.user}); {RESTART}")


def add_parser(adm: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``pfs admin key ...`` under ``adm`` (the ``pfs admin`` subcommands)."""
    keys = adm.add_parser("key", help="create, list and revoke node keys (uid/gid ranges, "
                                      "root)").add_subparsers(dest="keycmd", required=True)

    def where(sp: argparse.ArgumentParser) -> None:
        g = sp.add_mutually_exclusive_group(required=True)
        g.add_argument("--config", help="the metaserver's config (meta.toml)")
        g.add_argument("--cluster", metavar="DIR", help="a `pfs cluster` directory")
        sp.set_defaults(fn=cmd_key)

    sp = keys.add_parser("create", help="make a node key and add it to the config")
    sp.add_argument("name")
    sp.add_argument("--uids", type=_range, metavar="LO-HI",
                    help="uids its holder may act as (default: all; with --owner: the "
                         "user's)")
    sp.add_argument("--gids", type=_range, metavar="LO-HI",
                    help="gids its holder may act as (default: all; with --owner: the "
                         "user's primary group)")
    sp.add_argument("--owner", metavar="USER",
                    help="a user key: USER's uid and gid only, never root; USER's copy "
                         "and a client config go to --user-dir, written as USER")
    sp.add_argument("--user-dir", metavar="DIR",
                    help="with --owner: where USER's copy goes (default "
                         "~USER/.config/pfs, where the client looks)")
    sp.add_argument("--allow-root", action="store_true",
                    help="may act as uid 0 (an admin key); without it root is squashed")
    sp.add_argument("--key-dir", help="where the key file goes (default: beside the "
                                      "cluster key)")
    where(sp)
    sp = keys.add_parser("list", help="the node keys of the config, with their ranges")
    sp.add_argument("--json", action="store_true", help="one JSON document for scripts")
    where(sp)
    sp = keys.add_parser("revoke", help="remove a node key from the config, delete its file")
    sp.add_argument("name")
    where(sp)
