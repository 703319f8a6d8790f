"""The command blocks of deploy/README.md, and the systemd units they start, as data for
tests/mount/test_deploy_guide.py (which runs them on network namespaces).

A block is a fenced ``sh`` block right after a marker line::

    <!-- run on="data1 data2 client2" step="services" as="loader" -->

``on``: the hosts it runs on (``all``: every host); ``step`` (optional): ``variables``,
``install`` or ``services``, the blocks the test treats apart (deploy/README.md, "This
guide is a test"); ``as`` (optional): ``loader``, run as the loader user. Every ``sh``
block has a marker, so none is skipped by accident.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

MARKER = re.compile(r"^<!--\s*run\s+(.*?)\s*-->\s*$")
ATTR = re.compile(r'(\w+)="([^"]*)"')
STEPS = ("", "variables", "install", "services")
ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=")


class GuideError(ValueError):
    pass


@dataclass(frozen=True)
class Block:
    hosts: tuple[str, ...]
    text: str
    line: int  # of the opening fence, 1-based
    step: str = ""
    as_user: str = ""


def blocks(path: Path, all_hosts: tuple[str, ...]) -> list[Block]:
    """The marked ``sh`` blocks of ``path`` in order; an unmarked one is an error."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    attrs: dict[str, str] | None = None
    i = 0
    while i < len(lines):
        ln = lines[i]
        m = MARKER.match(ln)
        if m:
            attrs = dict(ATTR.findall(m.group(1)))
        elif ln.strip() == "```sh":
            if attrs is None:
                raise GuideError(f"{path}:{i + 1}: sh block without a <!-- run on=... --> line")
            start = i + 1
            j = start
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            if j == len(lines):
                raise GuideError(f"{path}:{i + 1}: unclosed block")
            out.append(_block(path, i + 1, attrs, "\n".join(lines[start:j]) + "\n",
                              all_hosts))
            attrs, i = None, j
        elif ln.strip():
            attrs = None  # a marker applies to the block right after it
        i += 1
    return out


def _block(path: Path, line: int, attrs: dict[str, str], text: str,
           all_hosts: tuple[str, ...]) -> Block:
    where = f"{path}:{line}"
    unknown = set(attrs) - {"on", "step", "as"}
    if unknown or "on" not in attrs:
        raise GuideError(f"{where}: marker wants on=\"HOSTS\" [step=...] [as=loader], "
                         f"not {sorted(attrs)}")
    hosts = all_hosts if attrs["on"] == "all" else tuple(attrs["on"].split())
    if not hosts or set(hosts) - set(all_hosts):
        raise GuideError(f"{where}: unknown hosts {attrs['on']!r}; known: {all_hosts}")
    step = attrs.get("step", "")
    if step not in STEPS or attrs.get("as", "loader") != "loader":
        raise GuideError(f"{where}: step {step!r} or as={attrs.get('as')!r} unknown")
    return Block(hosts, text, line, step, attrs.get("as", ""))


def assigned_names(block: Block) -> set[str]:
    """The variables a ``variables`` block sets (``NAME=value`` lines)."""
    names = set()
    for ln in block.text.splitlines():
        ln = ln.split("#", 1)[0].strip()
        m = ASSIGN.match(ln)
        if m:
            names.add(m.group(1))
    return names


def started_units(calls: str) -> list[str]:
    """The units a services block asked for, from its ``systemctl`` calls (one a line,
    the arguments separated by \\x1f)."""
    units = []
    for call in calls.splitlines():
        args = [a for a in call.split("\x1f") if a]
        if args[:2] == ["enable", "--now"] or args[:1] == ["start"]:
            units += [a for a in args[1:] if not a.startswith("--")]
    return units


def unescape_path(instance: str) -> str:
    """systemd's ``%I`` of a path-escaped instance (``systemd-escape --path``), without
    the leading slash: ``-`` is ``/``, ``\\xNN`` the byte NN."""
    return re.sub(r"\\x([0-9a-fA-F]{2})", lambda m: chr(int(m.group(1), 16)),
                  instance.replace("-", "/"))


@dataclass
class Unit:
    name: str
    exec_start_pre: list[list[str]] = field(default_factory=list)
    exec_start: list[str] = field(default_factory=list)
    exec_stop: list[list[str]] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)


def load_unit(unit_dir: Path, name: str, paths: dict[str, str]) -> Unit:
    """The commands of unit ``name`` (``pfs-data@0``) from its file in ``unit_dir``, with
    each ``paths`` key replaced by its value and the instance specifiers filled in."""
    base, at, instance = name.removesuffix(".service").partition("@")
    text = (unit_dir / f"{base}{at}.service").read_text()
    for old, new in paths.items():
        text = text.replace(old, new)
    text = text.replace("%i", instance).replace("%I", unescape_path(instance))
    unit = Unit(name)
    for ln in text.splitlines():
        key, sep, value = ln.partition("=")
        if not sep:
            continue
        if key in ("ExecStart", "ExecStartPre", "ExecStop") and value[:1] in "-@+!:":
            raise GuideError(f"{name}: {key} prefix {value[0]!r} is not supported by the test")
        if key == "ExecStart":
            unit.exec_start = shlex.split(value)
        elif key == "ExecStartPre":
            unit.exec_start_pre.append(shlex.split(value))
        elif key == "ExecStop":
            unit.exec_stop.append(shlex.split(value))
        elif key == "Environment":
            for item in shlex.split(value):
                k, _, v = item.partition("=")
                unit.environment[k] = v
    if not unit.exec_start:
        raise GuideError(f"{name}: no ExecStart")
    return unit
