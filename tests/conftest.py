"""Shared fixtures: real clusters of server processes on loopback."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from pfs.tools import cluster

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


# -- tiers: `pytest -m unit|integration|mount|slow` -------------------------------------
# The tier of a test is its folder: unit (no processes), integration (real server
# processes), mount (FUSE).
TIERS = ("unit", "integration", "mount")
# Tests of another tier that mount pfs too, so that `-m "not mount"` leaves them out.
ALSO_MOUNT = {"test_bench_io500.py::test_phases_mount", "test_bench_sweep.py::test_mount"}
# Tests that take 2 s or more (`-m "not slow"` for a quick run).
SLOW = {
    "test_bench.py::test_sigterm_stops_the_clusters_a_bench_started",
    "test_bench.py::test_wire_reads",
    "test_bench_io500.py::test_phases_mount",
    "test_bench_sweep.py::test_mount",
    "test_bench_sweep.py::test_quick_local_and_native",
    "test_cluster.py::test_a_dirty_close_outlasts_a_metaserver_outage",
    "test_checksums.py::test_missing_object_is_eio_and_scrubber_finds_a_flip",
    "test_cluster.py::test_cli_round_trip",
    "test_cluster.py::test_kill_9_metaserver_keeps_every_acknowledged_change",
    "test_cluster.py::test_metaserver_down_is_an_error_then_recovers",
    "test_cluster.py::test_open_handles_survive_a_metaserver_restart",
    "test_direct.py::test_a_close_with_nothing_to_commit_rides_on_the_next_call",
    "test_floods.py::test_flood_of_unauthenticated_connections_against_servers_at_1024_descriptors",
    "test_floods.py::test_an_idle_unauthenticated_connection_is_closed",
    "test_least_privilege.py::test_servers_create_private_files",
    "test_user_keys.py::test_a_user_with_a_key_of_their_own",
    "test_backup.py::test_backup_while_writing_then_restore",
    "test_server_logs.py::test_servers_log_start_registration_peers_and_shutdown",
    "test_least_privilege.py::test_a_store_made_before_is_made_private_at_start",
    "test_least_privilege.py::test_node_keys_without_root_are_squashed_and_admin_keys_are_not",
    "test_fuse_model.py::test_model",
    "test_kvcache.py::test_bench_kvcache_runs",
    "test_kvcache.py::test_many_processes_share_blocks_every_byte_checked",
    "test_kvcache.py::test_server_killed_restarted_added_removed",
    "test_fuse_mount.py::test_metaserver_gone_and_back",
    "test_meta_server.py::test_deleter_survives_a_failed_commit",
    "test_meta_server.py::test_deletions_stuck_on_one_server_do_not_block_the_rest",
    "test_meta_server.py::test_failed_deletion_is_retried_soon",
    "test_protocol.py::test_frames_round_trip_in_any_chunking",
    "test_security.py::test_bench_caps_runs",
    "test_security.py::test_decoder_survives_mutated_frames",
    "test_security.py::test_seeded_fuzz_against_live_servers",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = item.path.parent.name
        if tier in TIERS:
            item.add_marker(tier)
        key = f"{item.path.name}::{getattr(item, 'originalname', item.name)}"
        if key in ALSO_MOUNT:
            item.add_marker("mount")
        if key in SLOW:
            item.add_marker("slow")
