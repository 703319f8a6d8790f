"""Shared fixtures: real clusters of server processes on loopback."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from pfs import cluster

# Shared CI machines are noisy: hypothesis must judge correctness, not speed.
settings.register_profile("pfs", deadline=None)
settings.load_profile("pfs")


@pytest.fixture(scope="session")
def cluster_dir() -> Iterator[Path]:
    """A cluster of one metaserver and 4 data servers, shared by the session's tests."""
    d = Path(tempfile.mkdtemp(prefix="pfs-test-cluster-"))
    try:
        cluster.up(d, data_servers=4)
        yield d
    finally:
        cluster.down(d)
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def client_toml(cluster_dir: Path) -> Path:
    return cluster_dir / "client.toml"


@pytest.fixture
def client(client_toml: Path):
    import pfs

    c = pfs.connect(config=client_toml)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def workdir(client, request) -> str:
    """A fresh directory in the shared cluster for one test."""
    name = "/t-" + request.node.name.replace("[", "-").replace("]", "").replace("/", "_")[:100]
    name += f"-{os.getpid()}-{id(request)}"
    client.makedirs(name)
    return name


@pytest.fixture
def private_cluster(tmp_path: Path) -> Iterator[Path]:
    """A cluster of its own, for tests that stop, kill or restart servers."""
    d = tmp_path / "cluster"
    try:
        yield d
    finally:
        cluster.down(d) if d.exists() else None


def run_threads(target, n: int) -> list[BaseException]:
    """Run ``target(i)`` for i in range(n), each in its own thread; what they raised."""
    import threading

    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors
