"""``pfs bench io500``'s C loops (pfs/bench/io500_loops.c) against its Python loops: the
same files, sizes, contents and counts phase by phase on a local directory; each C loop's
errors as OSError with the errno and path; and the Python loops taking over, said in the
output, when the library cannot be built. Nothing here judges speed."""
from __future__ import annotations

import ctypes
import errno
import hashlib
import mmap
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

from pfs.bench import io500, io500_loops
from pfs.bench.io500 import HARD_FILE_SIZE, Io500Config, Target

T = 64 << 10


def cfg(**kw: Any) -> Io500Config:
    base: dict[str, Any] = dict(stonewall=0.0, easy_size=3 * T, easy_transfer=T,
                                hard_segments=5, easy_files=30, hard_files=120, verify=True,
                                timestamp="t", seed=4242, md_pause=0.0)
    base.update(kw)
    return Io500Config(**base)


@pytest.fixture()
def c_loops() -> io500_loops.CLoops:
    io500_loops.reset()
    lib, why = io500_loops.load()
    if lib is None:
        assert not (shutil.which("cc") or shutil.which("gcc")), why  # a compiler must build it
        pytest.skip(f"no C loops: {why}")
    return lib


@pytest.fixture()
def no_c(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv(io500_loops.ENV_OFF, "1")
    io500_loops.reset()
    yield
    monkeypatch.delenv(io500_loops.ENV_OFF)
    io500_loops.reset()


def snapshot(root: Path) -> dict[str, tuple[int, str] | None]:
    """Every path under ``root``: None for a directory, else (size, sha256 of the bytes)."""
    out: dict[str, tuple[int, str] | None] = {}
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in files:
            p = os.path.join(dirpath, f)
            body = Path(p).read_bytes()
            out[os.path.relpath(p, root)] = (len(body), hashlib.sha256(body).hexdigest())
    return out


def run_all(root: Path, n: int) -> list[tuple[str, dict[str, int], dict[str, Any]]]:
    """Every phase on ``n`` ranks; after each, its counts and the whole tree."""
    seen: list[tuple[str, dict[str, int], dict[str, Any]]] = []

    def hook(rec: dict[str, Any]) -> None:
        counts = {k: rec.get(k, 0) for k in ("items", "bytes", "verify_errors", "found")}
        if rec["name"] != "find":  # the ranks take find's directories as they come
            counts["per_rank"] = rec["items_per_rank"]
        seen.append((rec["name"], counts, snapshot(root)))

    res = io500.run_local(cfg(), Target("posix", str(root)), n, hook)
    assert all(not p["verify_errors"] for p in res["phases"])
    assert list(root.iterdir()) == []
    return seen


@pytest.mark.parametrize("n", [1, 2])
def test_c_and_python_do_the_same_work(tmp_path: Path, c_loops: io500_loops.CLoops,
                                       monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "py").mkdir()
    with_c = run_all(tmp_path / "c", n)
    monkeypatch.setenv(io500_loops.ENV_OFF, "1")  # the spawned ranks inherit it
    io500_loops.reset()
    try:
        with_py = run_all(tmp_path / "py", n)
    finally:
        monkeypatch.delenv(io500_loops.ENV_OFF)
        io500_loops.reset()
    assert [s[0] for s in with_c] == [s[0] for s in with_py] == [p for p, _, _ in io500.PHASES]
    for (name, counts_c, tree_c), (_, counts_py, tree_py) in zip(with_c, with_py, strict=True):
        assert counts_c == counts_py, name
        assert tree_c == tree_py, name  # names, sizes and every byte
    found = dict((s[0], s[1]) for s in with_c)["find"]
    assert found["found"] == io500.expected_found([120] * n) and found["found"] > 0


def test_md_loops_directly(tmp_path: Path, c_loops: io500_loops.CLoops) -> None:
    d = str(tmp_path)
    data = bytearray(io500.ior_pattern(7, HARD_FILE_SIZE))  # IOR's words after the stamp
    body = bytes(data[24:])
    assert c_loops.md_create(d, 3, 0, 10, 0.0, data, 7) == 0  # the stonewall passed already
    assert c_loops.md_create(d, 3, 0, 4, float("inf"), data, 7) == 4
    assert c_loops.md_create(d, 3, 4, 10, float("inf"), data, 7) == 10  # the wear-out resumes
    assert sorted(os.listdir(d)) == sorted(f"file.mdtest.3.{i}" for i in range(10))
    head = (tmp_path / "file.mdtest.3.6").read_bytes()
    assert head[:24] == io500.HEADER.pack(6, 4, 7) and head[24:] == body
    assert c_loops.md_stat(d, 3, 10, HARD_FILE_SIZE) == (10, 0)
    assert c_loops.md_stat(d, 3, 10, 0) == (10, 10)  # every size wrong
    assert c_loops.md_read(d, 3, 10, HARD_FILE_SIZE, body, 7, True) == \
        (10, 10 * HARD_FILE_SIZE, 0)
    with open(tmp_path / "file.mdtest.3.2", "r+b") as f:  # one flipped byte in the tail
        f.seek(HARD_FILE_SIZE - 1)
        f.write(b"\0" if body[-1] else b"\1")
    assert c_loops.md_read(d, 3, 10, HARD_FILE_SIZE, body, 7, True)[2] == 1
    with open(tmp_path / "file.mdtest.3.5", "r+b") as f:  # and one in a word of IOR's
        f.seek(1000)
        f.write(bytes([body[1000 - 24] ^ 1]))
    assert c_loops.md_read(d, 3, 10, HARD_FILE_SIZE, body, 7, True)[2] == 2
    assert c_loops.md_read(d, 3, 10, HARD_FILE_SIZE, body, 7, False)[2] == 0
    assert c_loops.md_unlink(d, 3, 10) == 10
    assert os.listdir(d) == []


def test_c_errors_are_oserrors_naming_the_path(tmp_path: Path,
                                               c_loops: io500_loops.CLoops) -> None:
    d = str(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        c_loops.md_stat(d, 0, 1, 0)
    assert e.value.errno == errno.ENOENT and e.value.filename == f"{d}/file.mdtest.0.0"
    with pytest.raises(FileNotFoundError):
        c_loops.md_unlink(d, 0, 1)
    with pytest.raises(FileNotFoundError) as e:
        c_loops.md_create(f"{d}/missing", 0, 0, 1, float("inf"), bytearray(), 0)
    assert e.value.filename == f"{d}/missing/file.mdtest.0.0"
    with pytest.raises(FileNotFoundError) as e:
        c_loops.find_open(f"{d}/missing", HARD_FILE_SIZE, 0)
    assert e.value.filename == f"{d}/missing"
    with pytest.raises(FileNotFoundError) as e:
        c_loops.find_lstat(f"{d}/missing01", HARD_FILE_SIZE, 0)
    assert e.value.filename == f"{d}/missing01"


def whole_dir(c_loops: io500_loops.CLoops, d: str, newer: int) -> tuple[int, int, list[Any]]:
    """A directory read to its end (chunks of 1,001 entries) with its files lstat'ed."""
    cur = c_loops.find_open(d, HARD_FILE_SIZE, newer)
    files = found = 0
    queued: list[Any] = []
    fin = False
    while not fin:
        nf, nfound, items, fin = cur.chunk(1000, 1 << 30)
        files, found, queued = files + nf, found + nfound, queued + items
    for kind, path, _ in queued:
        if kind == "f":
            files, found = files + 1, found + c_loops.find_lstat(path, HARD_FILE_SIZE, newer)
    return files, found, queued


def test_find_chunks_count_as_the_python_walk(tmp_path: Path,
                                              c_loops: io500_loops.CLoops) -> None:
    (tmp_path / "sub01").mkdir()  # a directory is never counted, whatever its name
    (tmp_path / "sub").mkdir()
    (tmp_path / "a01").write_bytes(b"x" * HARD_FILE_SIZE)  # found
    (tmp_path / "b01").write_bytes(b"x" * 10)  # matches the name, not the size
    (tmp_path / "c").write_bytes(b"x" * HARD_FILE_SIZE)  # not the name: counted at once
    os.symlink("a01", tmp_path / "l01")  # lstat: a link, not 3901 bytes
    files, found, queued = whole_dir(c_loops, str(tmp_path), 0)
    assert (files, found) == (4, 1)
    assert sorted(queued) == sorted([("d", f"{tmp_path}/sub", None),
                                     ("d", f"{tmp_path}/sub01", None),
                                     ("f", f"{tmp_path}/a01", None),
                                     ("f", f"{tmp_path}/b01", None),
                                     ("f", f"{tmp_path}/l01", None)])
    # -newer: ctime in whole seconds at or after the timestamp's
    ctime = int(os.lstat(tmp_path / "a01").st_ctime)
    assert whole_dir(c_loops, str(tmp_path), ctime)[1] == 1
    assert whole_dir(c_loops, str(tmp_path), ctime + 1)[1] == 0


def test_find_chunk_sizes_and_a_full_queue(tmp_path: Path,
                                           c_loops: io500_loops.CLoops) -> None:
    """pfind reads at most max_entries_per_iter + 1 entries a turn, and stops at the
    first entry it cannot queue, marking it for its excess list (D) or an lstat now (F)."""
    for i in range(2500):
        (tmp_path / f"x{i}").touch()
    cur = c_loops.find_open(str(tmp_path), HARD_FILE_SIZE, 0)
    got = [cur.chunk(1000, 1 << 30) for _ in range(3)]
    # entries processed: those counted and those queued (names with "01" are lstat jobs)
    assert [(g[0] + len(g[2]), g[3]) for g in got] == [(1001, False), (1001, False),
                                                        (498, True)]
    full = tmp_path / "full"
    for i in range(3):
        (full / f"d{i}").mkdir(parents=True)
    (full / "a01").touch()
    cur = c_loops.find_open(str(full), HARD_FILE_SIZE, 0)
    _, _, items, fin = cur.chunk(1000, 2)  # room for two: the third is marked
    assert [k in "df" for k, _, _ in items] == [True, True, False] and not fin
    _, _, items2, fin2 = cur.chunk(1000, 0)  # no room: the next entry is marked at once
    assert len(items2) == 1 and items2[0][0] in "DF" and not fin2
    assert {p for _, p, _ in items + items2} == {f"{full}/{n}" for n in ("d0", "d1", "d2", "a01")}
    assert cur.chunk(1000, 0) == (0, 0, [], True)
    cur.close()


def test_fallback_when_the_library_cannot_be_built(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    io500_loops.reset()
    try:
        lib, why = io500_loops.load()
        assert lib is None and "no-such-cc" in why
        assert io500.loops_note().startswith("[NOTE  ] C loops unavailable: ")
        root = tmp_path / "d"
        root.mkdir()
        res = io500.run_local(cfg(), Target("posix", str(root)), 1)  # the Python loops
        ph = {p["name"]: p for p in res["phases"]}
        assert ph["mdtest-hard-read"]["items"] == 120 and ph["find"]["found"] == 1
        assert not any(p["verify_errors"] for p in res["phases"])
    finally:
        io500_loops.reset()


def test_switched_off(no_c: Any) -> None:
    lib, why = io500_loops.load()
    assert lib is None and io500_loops.ENV_OFF in why
    assert "C loops unavailable" in io500.loops_note()


def test_c_loops_said_in_the_output(c_loops: io500_loops.CLoops) -> None:
    assert io500.loops_note().startswith("[NOTE  ] C loops: ")


def test_ior_buffers_are_page_aligned_and_hold_iors_timestamp_words() -> None:
    """IOR's transfer buffer is page-aligned (aligned_buffer_alloc): one 16 bytes into a
    page, as malloc gives, makes the kernel's copy from the page cache slower."""
    pat = io500.ior_pattern((1 << 40) + 99, 47008)
    words = struct.unpack(f"={len(pat) // 8}Q", pat)
    assert words[:3] == (99, 100, 101) and words[-1] == 99 + 47008 // 8 - 1
    buf = io500.aligned_buffer(pat)
    view = (ctypes.c_char * len(buf)).from_buffer(buf)
    assert ctypes.addressof(view) % mmap.PAGESIZE == 0 and bytes(buf) == pat
    del view
