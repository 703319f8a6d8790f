"""``pfs mount`` and ``pfs umount``: the pfs namespace as a FUSE filesystem.

    pfs mount [--config FILE | --meta HOST:PORT] MOUNTPOINT [-f] [-o OPT[,OPT...]]
    pfs umount [-z] MOUNTPOINT

By default the mount runs in the background: ``pfs mount`` starts a daemon process (its
own session, working directory ``/``) that connects to the metaserver, mounts, and writes
``ok`` (or ``error <message>``) to a pipe; the parent returns once that report came and
the mount point answers a ``stat``. ``-f`` serves in the foreground and logs to stderr.
SIGINT and SIGTERM unmount cleanly; so does ``pfs umount`` (or ``fusermount3 -u``).

Options (``-o``, comma separated, repeatable; fstab style):

=====================  ==================================================================
entry_timeout=S        seconds the kernel caches names (default 1)
attr_timeout=S         seconds the kernel caches attributes (default 1)
negative_timeout=S     seconds the kernel caches "no such name" (default 0)
timeout=S              seconds before a metaserver/data server call fails with ETIMEDOUT
                       (default 30): a server that is gone never hangs a process
read_ahead_kb=N        kernel readahead of the mount (default 4096; 0 keeps the kernel's)
max_tasks=N            requests served concurrently at most (default 64)
write_behind=N         writes in flight per open file, answered before they land; errors
                       come back from the next write, close or fsync (default 16; 0: off)
logfile=PATH           where the background daemon logs (default: nowhere)
debug                  log every error reply
ro / rw                read-only mount: writes fail with EROFS
default_permissions    the kernel checks permissions too, from the cached attributes
                       (default; the metaserver checks every request regardless)
nodefault_permissions  only the metaserver checks (names the kernel has cached are then
                       not re-checked against the caller)
allow_other            other users may use the mount (needed for non-root users when
                       mounted by root)
config=FILE, meta=H:P  the cluster, as ``--config`` / ``--meta`` (for fstab)
fsname=, subtype=, max_read=, allow_root, auto_unmount, and the generic mount flags
(nosuid, nodev, noexec, noatime, ...) go to libfuse/the kernel; defaults, auto, noauto,
user, users, nofail, _netdev and x-* are accepted and ignored, as mount(8) does.
=====================  ==================================================================

An fstab line: ``pfs  /mnt/pfs  fuse.pfs  meta=10.0.0.1:9400,allow_other,_netdev  0 0``
with a ``mount.fuse.pfs`` helper that runs ``pfs mount``; or run ``pfs mount`` directly.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import logging
import os
import signal
import subprocess
import sys
from typing import Any

from pfs.core import logs, metrics
from pfs.core.daemon import wait_ready
from pfs.fuse.options import MountError, MountOptions, parse_options

log = logging.getLogger(__name__)

READY_TIMEOUT = 60.0
# pyfuse3 workers kept waiting for requests: with one, every request that arrives while
# another is served (a RELEASE behind the next LOOKUP) starts a task that exits after it
MIN_TASKS = 4
UMOUNT_TIMEOUT = 30.0


# -- /proc/self/mountinfo ------------------------------------------------------
def _unescape(field_: str) -> str:
    out, i = [], 0
    while i < len(field_):
        if field_[i] == "\\" and field_[i + 1 : i + 4].isdigit():
            out.append(chr(int(field_[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field_[i])
            i += 1
    return "".join(out)


def mount_entry(mountpoint: str) -> dict[str, str] | None:
    """The mountinfo record of the mount at ``mountpoint`` (the last one stacked there)."""
    mp = os.path.abspath(mountpoint)
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            parts, tail = pre.split(), post.split()
            if len(parts) >= 5 and _unescape(parts[4]) == mp and len(tail) >= 2:
                found = {"dev": parts[2], "fstype": tail[0], "source": _unescape(tail[1])}
    return found


def is_pfs_mount(mountpoint: str) -> bool:
    e = mount_entry(mountpoint)
    return e is not None and e["fstype"] == "fuse.pfs"


# -- serving -------------------------------------------------------------------
def _set_read_ahead(mountpoint: str, kb: int) -> None:
    """Raise the mount's readahead (the kernel starts FUSE mounts at 128 KiB), so
    sequential reads arrive as large requests. Best effort: it needs root."""
    e = mount_entry(mountpoint)
    if e is None or kb <= 0:
        return
    path = f"/sys/class/bdi/{e['dev']}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(kb))
    except OSError as exc:
        log.info("cannot set %s: %s", path, exc.strerror)


async def serve(cfg: Any, mountpoint: str, opts: MountOptions, ready: Any = None) -> None:
    """Connect, mount, serve until unmounted or signalled; ``ready(err)`` reports the
    outcome of mounting (``err`` None on success)."""
    import pyfuse3
    import trio

    from pfs.client.aio import AsyncClient
    from pfs.fuse import workers
    from pfs.fuse.counting import count_requests
    from pfs.fuse.ops import PfsOperations

    def report(err: str | None) -> None:
        nonlocal ready
        if ready is not None:
            ready(err)
            ready = None

    mounted = False
    try:
        async with trio.open_nursery() as nursery:
            client = AsyncClient(cfg, nursery)
            # a RELEASE of a handle with nothing to commit rides on the next request
            # (or a batched release within CLOSE_DELAY): no round trip of its own
            client.meta.defer_closes = True
            try:
                try:
                    await client.meta.hello(f"pfs-fuse-{os.getpid()}")
                except OSError as exc:
                    raise MountError(f"metaserver {cfg.meta}: {exc.strerror or exc}") from None
                ops = PfsOperations(client, opts.tuning)
                count_requests(ops)  # by opcode, while /metrics is served
                try:
                    pyfuse3.init(ops, mountpoint, opts.fuse_options(cfg.meta))
                except RuntimeError as exc:
                    raise MountError(f"cannot mount on {mountpoint}: {exc}") from None
                mounted = True
                workers.install(pyfuse3)
                nursery.start_soon(_stop_on_signal, pyfuse3)

                async def answered() -> None:
                    # served by the loop below: once it answers, the kernel's FUSE_INIT
                    # is done (it resets the readahead) and the mount is usable
                    try:
                        await trio.to_thread.run_sync(os.stat, mountpoint)
                    except OSError as exc:
                        report(f"{mountpoint} does not answer: {exc.strerror}")
                        pyfuse3.terminate()
                        return
                    _set_read_ahead(mountpoint, opts.read_ahead_kb)
                    log.info("pfs (%s) mounted on %s", cfg.meta, mountpoint)
                    report(None)

                nursery.start_soon(answered)
                try:
                    await pyfuse3.main(
                        min_tasks=min(MIN_TASKS, opts.max_tasks), max_tasks=opts.max_tasks
                    )
                finally:
                    with trio.CancelScope(shield=True), trio.move_on_after(opts.timeout):
                        await ops.close_all()
            finally:
                client.close()
                nursery.cancel_scope.cancel()
    except MountError as exc:
        report(str(exc))
        raise
    except BaseExceptionGroup as group:  # raised inside the nursery
        matched, rest = group.split(MountError)
        if matched is None or rest is not None:
            raise
        first: BaseException = matched.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        report(str(first))
        raise first from None
    finally:
        if mounted:
            pyfuse3.close(unmount=True)
            log.info("pfs unmounted from %s", mountpoint)


async def _stop_on_signal(pyfuse3: Any) -> None:
    import trio

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as sigs:
        async for signum in sigs:
            log.info("%s: unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return


def run_foreground(
    cfg: Any, mountpoint: str, opts: MountOptions, ready_fd: int | None = None
) -> int:
    import trio

    def ready(err: str | None) -> None:
        if ready_fd is None:
            return
        try:
            os.write(ready_fd, b"ok\n" if err is None else f"error {err}\n".encode())
        finally:
            os.close(ready_fd)

    try:
        trio.run(serve, cfg, mountpoint, opts, ready)
    except MountError as exc:
        log.error("%s", exc)
        print(f"pfs mount: {exc}", file=sys.stderr)
        return 1
    return 0


def _start_daemon(argv: list[str], mountpoint: str, logfile: str | None) -> None:
    """Start the mount daemon; return once it mounted and the mount answers."""
    rfd, wfd = os.pipe()
    out = open(logfile, "ab") if logfile else open(os.devnull, "wb")  # noqa: SIM115
    try:
        proc = subprocess.Popen(
            [*argv, "--ready-fd", str(wfd)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            pass_fds=(wfd,),
            start_new_session=True,
            cwd="/",
        )
    finally:
        os.close(wfd)
        out.close()
    try:
        line = wait_ready(rfd, READY_TIMEOUT)
    except TimeoutError:
        proc.kill()
        raise MountError(f"the mount daemon did not report in {READY_TIMEOUT:g} s") from None
    finally:
        os.close(rfd)
    if line is None:
        code = proc.wait()
        raise MountError(
            f"the mount daemon exited (status {code}) before mounting"
            + (f"; see {logfile}" if logfile else "")
        )
    text = line.decode(errors="replace").strip()
    if text != "ok":
        proc.wait()
        raise MountError(text.removeprefix("error "))
    try:
        os.stat(mountpoint)  # answered by the daemon: the mount serves
    except OSError as exc:
        raise MountError(f"{mountpoint} does not answer: {exc.strerror}") from None


def cmd_mount(args: argparse.Namespace) -> None:
    from pfs.core.config import ConfigError, client_config, find_client_config

    try:
        opts = parse_options(args.options or [])
        config = args.config or opts.config
        meta = args.meta or opts.meta
        if not config and (not meta or os.environ.get("PFS_CONFIG")):
            config = str(find_client_config())  # named to the daemon, which may not look
        cfg = client_config(os.path.abspath(config) if config else None, meta)
        cfg = dataclasses.replace(cfg, timeout=opts.timeout)
    except (MountError, ConfigError) as exc:
        raise SystemExit(f"pfs mount: {exc}") from None
    mountpoint = os.path.abspath(args.mountpoint)
    if not os.path.isdir(mountpoint):
        raise SystemExit(f"pfs mount: {mountpoint} is not a directory")
    if is_pfs_mount(mountpoint):
        raise SystemExit(f"pfs mount: {mountpoint} is already a pfs mount")
    if args.foreground:
        logs.setup("DEBUG" if opts.debug else args.log_level or "INFO", args.log_format or "text")
        metrics.serve(cfg.metrics_port)  # client_config: /metrics of this mount (0: off)
        sys.exit(run_foreground(cfg, mountpoint, opts, args.ready_fd))
    argv = [sys.executable, "-m", "pfs.tools.cli", "mount", "-f", "--meta", cfg.meta]
    for flag, value in (("--log-level", args.log_level), ("--log-format", args.log_format)):
        argv += [flag, value] if value else []
    if config:
        argv += ["--config", os.path.abspath(config)]
    for item in args.options or []:
        argv += ["-o", item]
    argv.append(mountpoint)
    try:
        _start_daemon(argv, mountpoint, opts.logfile)
    except MountError as exc:
        raise SystemExit(f"pfs mount: {exc}") from None


def cmd_umount(args: argparse.Namespace) -> None:
    mountpoint = os.path.abspath(args.mountpoint)
    if mount_entry(mountpoint) is None:
        raise SystemExit(f"pfs umount: {mountpoint} is not mounted")
    cmds = [
        ["fusermount3", "-u"] + (["-z"] if args.lazy else []) + [mountpoint],
        ["umount"] + (["-l"] if args.lazy else []) + [mountpoint],
    ]
    err = ""
    for cmd in cmds:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=UMOUNT_TIMEOUT)
        except FileNotFoundError:
            continue
        except subprocess.TimeoutExpired:
            err = f"{cmd[0]} did not finish in {UMOUNT_TIMEOUT:g} s"
            continue
        if r.returncode == 0:
            return
        err = (r.stderr or r.stdout).strip()
        if "busy" in err.lower():
            break
    raise OSError(
        errno.EBUSY if "busy" in err.lower() else errno.EIO, f"cannot unmount {mountpoint}: {err}"
    )


def add_mount_parser(sub: Any, client_cmd: Any) -> None:
    """Register ``pfs mount`` and ``pfs umount`` (called by ``pfs.tools.cli.build_parser``)."""
    sp = client_cmd("mount", cmd_mount, "mount pfs with FUSE")
    sp.add_argument("mountpoint")
    sp.add_argument(
        "-f", "--foreground", action="store_true", help="stay in the foreground and log to stderr"
    )
    sp.add_argument(
        "-o",
        dest="options",
        action="append",
        metavar="OPT[,OPT...]",
        help="mount options: ro, rw, entry_timeout=S, attr_timeout=S, "
        "negative_timeout=S, timeout=S, read_ahead_kb=N, write_behind=N, "
        "max_tasks=N, logfile=PATH, debug, config=FILE, meta=HOST:PORT, "
        "nodefault_permissions, and FUSE's own (allow_other, ...)",
    )
    sp.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    logs.add_arguments(sp)  # of the mount daemon (with -f, or the one it starts)
    sp = sub.add_parser("umount", help="unmount a pfs FUSE mount")
    sp.add_argument("-z", "--lazy", action="store_true", help="detach now, clean up later")
    sp.add_argument("mountpoint")
    sp.set_defaults(fn=cmd_umount)
