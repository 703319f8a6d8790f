"""pfs:// through fsspec against a real cluster: fsspec's own abstract test suite
(copy, get, put, mv, open, pipe) and the everyday calls."""
from __future__ import annotations

import itertools
import os
import posixpath
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.tests import abstract

from pfs.fsspec import PfsFileSystem

ROOT = Path(__file__).resolve().parents[2]
_seq = itertools.count()


def test_the_entry_point_registers_pfs() -> None:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert spec["project"]["entry-points"]["fsspec.specs"]["pfs"] == "pfs.fsspec:PfsFileSystem"


@pytest.fixture
def pfs_fs(client_toml: Path) -> Iterator[PfsFileSystem]:
    if "pfs" not in fsspec.available_protocols():  # an install older than the entry point
        fsspec.register_implementation("pfs", PfsFileSystem)
    fs = fsspec.filesystem("pfs", config=str(client_toml))
    assert isinstance(fs, PfsFileSystem)
    yield fs


class PfsFixtures(abstract.AbstractFixtures):  # type: ignore[misc]
    @pytest.fixture
    def fs(self, pfs_fs: PfsFileSystem) -> PfsFileSystem:
        return pfs_fs

    @pytest.fixture
    def fs_join(self) -> Any:
        return posixpath.join

    @pytest.fixture
    def fs_path(self, pfs_fs: PfsFileSystem) -> str:
        path = f"/fsspec-{os.getpid()}-{next(_seq)}"
        pfs_fs.makedirs(path)
        return path


class TestPfsCopy(abstract.AbstractCopyTests, PfsFixtures):  # type: ignore[misc]
    pass


class TestPfsGet(abstract.AbstractGetTests, PfsFixtures):  # type: ignore[misc]
    pass


class TestPfsPut(abstract.AbstractPutTests, PfsFixtures):  # type: ignore[misc]
    pass


class TestPfsOpen(abstract.AbstractOpenTests, PfsFixtures):  # type: ignore[misc]
    pass


class TestPfsPipe(abstract.AbstractPipeTests, PfsFixtures):  # type: ignore[misc]
    pass


def test_everyday_calls(pfs_fs: PfsFileSystem, workdir: str, tmp_path: Path,
                        client_toml: Path) -> None:
    fs = pfs_fs
    url = f"pfs://{workdir}/a/x.bin"
    fs.mkdir(f"pfs://{workdir}/a")
    with fsspec.open(url, "wb", config=str(client_toml)) as f:
        f.write(b"hello")
    assert fs.cat(url) == b"hello"
    assert fs.info(url)["size"] == 5 and fs.info(url)["type"] == "file"
    assert fs.ls(f"{workdir}/a", detail=False) == [f"{workdir}/a/x.bin"]
    with fs.open(url, "r") as t:
        assert t.read() == "hello"
    local = tmp_path / "x.bin"
    fs.get(url, str(local))
    assert local.read_bytes() == b"hello"
    fs.put(str(local), f"{workdir}/a/y.bin")
    assert fs.cat(f"{workdir}/a/y.bin") == b"hello"
    with pytest.raises(FileNotFoundError):
        fs.info(f"{workdir}/nope")
    with pytest.raises(IsADirectoryError):
        fs.open(f"{workdir}/a", "rb")
    fs.rm(f"{workdir}/a", recursive=True)
    assert not fs.exists(f"{workdir}/a")
