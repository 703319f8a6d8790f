"""``python -m pfs.metaserver``: run the metadata server.

    python -m pfs.metaserver --config meta.toml
    python -m pfs.metaserver --db DIR [--host H] [--port P] [--ready-fd N]

``PFS_META_PROFILE=PATH`` in the environment runs it under cProfile and writes the
statistics to ``PATH.<pid>`` when it stops (finding where its CPU goes under a load).

``--ready-fd N`` writes the bound port and a newline to file descriptor N once the
server accepts connections, then closes it: a supervisor (``pfs cluster up``, tests)
learns readiness and the port without sleeping. SIGTERM and SIGINT stop it cleanly.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import sys
import time
from collections.abc import Callable

import trio

from pfs.core import logs
from pfs.core.config import ConfigError, MetaConfig, load
from pfs.core.daemon import log_crash, serve_until_signalled
from pfs.core.versions import FormatError, package_version
from pfs.metaserver.server import serve_meta

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pfs.metaserver", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="MetaConfig TOML file")
    p.add_argument("--db", help="LMDB directory (overrides the config)")
    p.add_argument("--host", help="address to listen on (overrides the config)")
    p.add_argument("--port", type=int, help="port to listen on; 0 picks one")
    p.add_argument("--map-size", type=int, help="LMDB map size in bytes")
    p.add_argument("--ready-fd", type=int, help="write the bound port to this fd when ready")
    p.add_argument("--key-file", help="the cluster key (docs/security.md)")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus /metrics on PORT (0: off, the default)")
    logs.add_arguments(p)
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> MetaConfig:
    config = load(MetaConfig, args.config) if args.config else MetaConfig()
    overrides = {k: v for k, v in (("db", args.db), ("host", args.host), ("port", args.port),
                                   ("map_size", args.map_size), ("key_file", args.key_file),
                                   ("metrics_port", args.metrics_port))
                 if v is not None}
    return dataclasses.replace(config, **overrides)


async def run(config: MetaConfig, ready_fd: int | None = None) -> None:
    await serve_until_signalled(functools.partial(serve_meta, config),
                                f"metaserver (db {config.db})", ready_fd)


def _profiled(path: str, fn: Callable[[], object]) -> None:
    """``fn()`` under cProfile; its statistics written to ``path.<pid>``, even when it
    fails."""
    import cProfile

    prof = cProfile.Profile(time.process_time)  # CPU, not the waits
    try:
        prof.runcall(fn)
    finally:
        prof.dump_stats(f"{path}.{os.getpid()}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = build_config(args)
    except ConfigError as exc:
        print(f"metaserver: {exc}", file=sys.stderr)
        return 2
    logs.setup(args.log_level or config.log_level, args.log_format or config.log_format)
    log.info("metaserver starting: config %s, db %s, listening on %s:%d, pfs %s, pid %d",
             args.config or "(none)", config.db, config.host, config.port, package_version(),
             os.getpid())
    failed: list[BaseException] = []
    crashed = 0
    profile_to = os.environ.get("PFS_META_PROFILE")
    try:
        if profile_to:
            _profiled(profile_to, lambda: trio.run(run, config, args.ready_fd))
        else:
            trio.run(run, config, args.ready_fd)
    except* ConfigError as group:  # a key file others can read, a missing certificate...
        failed.extend(group.exceptions)
    except* FormatError as group:  # a store this pfs cannot open: the message says what to run
        failed.extend(group.exceptions)
    except* Exception as group:  # a crash: logged with its traceback, then exit status 1
        crashed = log_crash("metaserver", group)
    for err in failed:
        log.error("metaserver: %s", getattr(err, "strerror", None) or err)
    return crashed or (2 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
