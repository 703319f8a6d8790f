"""Mount options: the ``-o`` list of ``pfs mount`` parsed into typed settings.

Unknown options are an error (a typo never passes silently as a default); libfuse's and
the kernel's own options are passed through; fstab bookkeeping options are ignored, as
mount(8) does. The table of options is in ``fuse/mount.py``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any


@dataclass
class MountTuning:
    """Kernel cache and policy knobs the FUSE operations use."""

    entry_timeout: float = 1.0
    attr_timeout: float = 1.0
    negative_timeout: float = 0.0  # 0: a missing name is not cached
    read_only: bool = False
    kernel_permissions: bool = True  # mounted with default_permissions
    write_behind: int = 16  # writes in flight per open file (0: each write waits)


# passed to libfuse / the kernel as they are (libfuse 3 fuse_mount_opts and mount flags)
_FUSE_FLAGS = {"allow_other", "allow_root", "auto_unmount", "suid", "nosuid", "dev", "nodev",
               "exec", "noexec", "async", "sync", "dirsync", "noatime", "nodiratime",
               "norelatime", "nostrictatime", "symfollow", "nosymfollow"}
_FUSE_VALUES = {"fsname", "subtype", "max_read", "context", "fscontext", "defcontext",
                "rootcontext"}
# mount(8) / fstab bookkeeping and kernel defaults, not for the filesystem
_IGNORED = {"defaults", "auto", "noauto", "user", "nouser", "users", "owner", "nofail",
            "_netdev", "comment", "atime", "diratime", "relatime", "strictatime", "lazytime",
            "nolazytime"}


class MountError(RuntimeError):
    pass


@dataclass
class MountOptions:
    tuning: MountTuning = field(default_factory=MountTuning)
    timeout: float = 30.0
    read_ahead_kb: int = 4096
    max_tasks: int = 64
    logfile: str | None = None
    debug: bool = False
    config: str | None = None
    meta: str | None = None
    fuse: list[str] = field(default_factory=list)  # options for libfuse

    def fuse_options(self, meta_addr: str) -> set[str]:
        opts = set(self.fuse)
        if not any(o.startswith("fsname=") for o in opts):
            opts.add(f"fsname=pfs:{meta_addr}")
        if not any(o.startswith("subtype=") for o in opts):
            opts.add("subtype=pfs")
        if self.tuning.kernel_permissions:
            opts.add("default_permissions")
        if self.tuning.read_only:
            opts.add("ro")
        return opts


def _number(key: str, value: str, kind: type) -> Any:
    try:
        n = kind(value)
    except ValueError:
        raise MountError(f"-o {key}={value}: not a number") from None
    if n < 0:
        raise MountError(f"-o {key}={value}: must not be negative")
    return n


def parse_options(items: list[str]) -> MountOptions:
    """``-o`` strings (each a comma-separated list) into :class:`MountOptions`."""
    o = MountOptions()
    for item in items:
        for opt in filter(None, (s.strip() for s in item.split(","))):
            key, eq, value = opt.partition("=")
            if eq and not value:
                raise MountError(f"-o {opt}: missing value")
            if key in ("entry_timeout", "attr_timeout", "negative_timeout") and eq:
                setattr(o.tuning, key, _number(key, value, float))
            elif key == "timeout" and eq:
                o.timeout = _number(key, value, float)
            elif key == "write_behind" and eq:
                o.tuning.write_behind = _number(key, value, int)
            elif key in ("read_ahead_kb", "max_tasks") and eq:
                setattr(o, key, _number(key, value, int))
            elif key == "logfile" and eq:
                o.logfile = os.path.abspath(value)
            elif key == "config" and eq:
                o.config = os.path.abspath(value)
            elif key == "meta" and eq:
                o.meta = value
            elif opt == "debug":
                o.debug = True
            elif opt in ("ro", "rw"):
                o.tuning.read_only = opt == "ro"
            elif opt == "default_permissions":
                o.tuning.kernel_permissions = True
            elif opt == "nodefault_permissions":
                o.tuning.kernel_permissions = False
            elif (opt in _FUSE_FLAGS and not eq) or (key in _FUSE_VALUES and eq):
                o.fuse.append(opt)
            elif key in _IGNORED or key.startswith("x-"):
                continue
            else:
                raise MountError(f"unknown mount option {opt!r}")
    if o.max_tasks < 1:
        raise MountError("-o max_tasks must be at least 1")
    return o
