"""Every request in the code base is a typed message (pfs/core/messages/): no request map
built by hand. Read from the source with ``ast``: a call of ``call``/``call_into`` naming
its method as a string (the untyped entry points, kept for tests that send what no
message allows), or a map literal with a method (``"m"``) or an object id (``"obj"``,
``"objs"``) key, outside the message layer and the wire layer that encodes it."""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pfs", "metaserver", "dataserver", "fuse")
# where request maps are made on purpose: the message layer, the frames of the wire, and
# the key handshake, whose two messages come before any RPC (pfs/core/auth.py)
ALLOWED = ("pfs/core/messages/", "pfs/core/wire/", "pfs/core/auth.py")
REQUEST_KEYS = {"m", "obj", "objs"}
UNTYPED_CALLS = {"call", "call_into"}


def _files() -> Iterator[Path]:
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(ALLOWED):
                yield path


def _may_be_name(v: ast.expr) -> bool:
    if isinstance(v, ast.Constant):
        return isinstance(v.value, str)
    return not isinstance(v, ast.BinOp)


def hand_built(source: str) -> list[tuple[int, str]]:
    """(line, what) for each hand-built request in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in UNTYPED_CALLS and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            found.append((node.lineno, f".{node.func.attr}({node.args[0].value!r}, ...)"))
        elif isinstance(node, ast.Dict):
            keys = {k.value for k, v in zip(node.keys, node.values, strict=True)
                    if isinstance(k, ast.Constant)
                    # a method is a name; {"k": 1 << 10, "m": 1 << 20} is no request
                    and not (k.value == "m" and not _may_be_name(v))}
            if keys & REQUEST_KEYS:
                found.append((node.lineno, f"a map with {sorted(str(k) for k in keys & REQUEST_KEYS)}"))
    return found


def test_the_check_finds_hand_built_requests() -> None:
    src = ('c.call("getattr", {"ino": 1})\nrpc.call_into("read", f)\n'
           'x = {"obj": [1, 0], "cap": c}\ny = {"m": "hello"}\n'
           'await rpc.request(M.Getattr(ino=1))\nz = {"ino": 1}\nu = {"k": 1 << 10, "m": 1 << 20}\n')
    assert [line for line, _ in hand_built(src)] == [1, 2, 3, 4]


@pytest.mark.parametrize("path", list(_files()), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_request_is_built_by_hand(path: Path) -> None:
    found = hand_built(path.read_text())
    assert not found, (f"{path.relative_to(ROOT)}: requests built by hand (build a message "
                       f"of pfs/core/messages instead): {found}")
