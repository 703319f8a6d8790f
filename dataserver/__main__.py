"""``python -m pfs.dataserver``: run a data server.

    python -m pfs.dataserver --config data.toml
    python -m pfs.dataserver --dir /nvme0/pfs --dir /nvme1/pfs --port 9500 --meta meta:9400

Options given on the command line override the config file. ``--ready-fd N`` writes the
bound port and a newline to file descriptor N once the server is listening (and
registered, when the metaserver is up), then closes it: a supervisor reads one line
instead of sleeping. SIGTERM and SIGINT stop the server cleanly (exit status 0).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import sys
from typing import Any

import trio

from pfs.core.config import ConfigError, DataConfig, load, parse_addr
from pfs.core.daemon import serve_until_signalled
from pfs.dataserver.server import serve_data

log = logging.getLogger("dataserver")


def parse_args(argv: list[str] | None = None) -> tuple[DataConfig, int | None, str, bool]:
    p = argparse.ArgumentParser(prog="python -m pfs.dataserver", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="TOML file with DataConfig keys")
    p.add_argument("--dir", action="append", dest="dirs", metavar="DIR",
                   help="data directory, one per drive (repeatable; replaces the config's)")
    p.add_argument("--host", help="address to listen on")
    p.add_argument("--port", type=int, help="port to listen on (0: any free port)")
    p.add_argument("--meta", help="metaserver HOST:PORT ('' runs without one)")
    p.add_argument("--engine", help="I/O engine: auto (uring where available), posix, uring")
    p.add_argument("--heartbeat", type=float, help="seconds between heartbeats")
    p.add_argument("--ready-fd", type=int, metavar="N",
                   help="write the bound port to fd N when ready, then close it")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING...")
    p.add_argument("--key-file", help="the cluster key (docs/security.md)")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus /metrics on PORT (0: off, the default)")
    p.add_argument("--scrub-rate", type=int, metavar="BYTES",
                   help="bytes/s the scrubber verifies (0: off)")
    p.add_argument("--no-checksums", action="store_true",
                   help="MEASUREMENT ONLY: keep no block checksums (objects written so "
                        "read unchecked)")
    p.add_argument("--domain", help="failure domain (a rack label; default: the host)")
    p.add_argument("--forward-timeout", type=float, metavar="S",
                   help="seconds a chain member waits for the next before reporting it")
    p.add_argument("--kv-budget", type=int, metavar="BYTES",
                   help="bytes of KV-cache blocks at most (0: none; -1: a tenth of the disk)")
    p.add_argument("--insecure-skip-caps", action="store_true",
                   help="TEST ONLY: do not check capabilities (the benchmark's off switch)")
    args = p.parse_args(argv)
    cfg = load(DataConfig, args.config) if args.config else DataConfig()
    overrides: dict[str, Any] = {k: v for k, v in (("dirs", args.dirs), ("host", args.host),
                                   ("port", args.port), ("meta", args.meta),
                                   ("engine", args.engine), ("heartbeat", args.heartbeat),
                                   ("key_file", args.key_file),
                                   ("scrub_rate", args.scrub_rate),
                                   ("metrics_port", args.metrics_port),
                                   ("domain", args.domain),
                                   ("forward_timeout", args.forward_timeout),
                                   ("kv_budget", args.kv_budget),
                                   ("checksums", False if args.no_checksums else None))
                 if v is not None}
    cfg = dataclasses.replace(cfg, **overrides)
    if cfg.meta:
        parse_addr(cfg.meta)
    if not 0 <= cfg.port < 65536:
        raise ConfigError(f"port {cfg.port} out of range")
    return cfg, args.ready_fd, args.log_level, args.insecure_skip_caps


async def run(cfg: DataConfig, ready_fd: int | None, skip_caps: bool = False) -> None:
    serve = functools.partial(serve_data, cfg, verify_caps=False if skip_caps else None)
    await serve_until_signalled(serve, f"data server (dirs {', '.join(cfg.dirs)})", ready_fd)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, ready_fd, level, skip_caps = parse_args(argv)
    except ConfigError as exc:
        print(f"dataserver: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    failed: list[BaseException] = []
    try:
        trio.run(run, cfg, ready_fd, skip_caps)
    except* (OSError, ConfigError) as group:  # a port in use, an unusable directory...
        failed.extend(group.exceptions)
    for err in failed:
        log.error("data server failed: %s", getattr(err, "strerror", None) or err)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
