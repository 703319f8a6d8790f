"""How pfs processes log: one handler on stderr (the journal, under systemd), at INFO
unless told otherwise, as text or as one JSON object per line (``--log-format json``:
``time``, ``level``, ``logger``, ``message``, and ``exc`` with the traceback when there
is one), for log shippers that should not parse free text (docs/architecture.md,
"Operations")."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import TextIO

FORMATS = ("text", "json")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (a traceback is a string inside it)."""

    def format(self, record: logging.LogRecord) -> str:
        t = time.gmtime(record.created)
        doc: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["exc"] = record.exc_text
        if record.stack_info:
            doc["stack"] = record.stack_info
        return json.dumps(doc, ensure_ascii=False, default=str)


def check(level: str, fmt: str) -> tuple[int, str]:
    """A level name and a format, checked (ValueError naming the choices)."""
    name = level.upper()
    if name not in LEVELS:
        raise ValueError(f"log level {level!r}: want one of {', '.join(LEVELS)}")
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: want one of {', '.join(FORMATS)}")
    return getattr(logging, name), fmt


def setup(level: str = "INFO", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Make the root logger this: ``level``, one handler on ``stream`` (stderr) in
    ``fmt``. Replaces handlers set before (``pfs``'s own set-up for its commands), so a
    server's choice is the one that holds."""
    lvl, fmt = check(level, fmt)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(lvl)
    logging.captureWarnings(True)  # Python's warnings as records too: one format on stderr


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--log-level`` and ``--log-format`` on a server's parser (None: the config's)."""
    p.add_argument("--log-level", default=None, type=str.upper, choices=LEVELS,
                   help="DEBUG, INFO (default), WARNING, ERROR, CRITICAL")
    p.add_argument("--log-format", default=None, choices=FORMATS,
                   help="text (default) or json: one JSON object per line (time, level, "
                        "logger, message, exc)")
