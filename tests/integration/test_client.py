"""The native client against a real cluster of server processes on loopback."""
from __future__ import annotations

import errno
import hashlib
import os
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import pfs

UNIT = 64 * 1024  # small units so modest files cross many stripe boundaries


@pytest.fixture
def striped(client, workdir) -> str:
    client.set_layout(workdir, count=4, unit=UNIT)
    return workdir


@pytest.mark.parametrize("size", [0, 1, UNIT - 1, UNIT, UNIT + 1, 4 * UNIT + 7, 13 * UNIT + 12345])
def test_odd_sizes_round_trip_through_every_api(client, striped, size: int) -> None:
    data = os.urandom(size)
    path = f"{striped}/f{size}"
    with client.open(path, "wb") as f:
        assert f.write(data) == size
    assert client.stat(path).st_size == size
    # whole-file read
    with client.open(path, "rb") as f:
        assert f.read() == data
    # readinto a bytearray, a memoryview and a numpy array
    buf = bytearray(size)
    with client.open(path, "rb") as f:
        assert f.readinto(buf) == size
    assert bytes(buf) == data
    arr = np.zeros(size, dtype=np.uint8)
    with client.open(path, "rb") as f:
        assert f.readinto(arr.data) == size
    assert arr.tobytes() == data
    # positional reads at random offsets and lengths
    rng = random.Random(size)
    with client.open(path, "rb") as f:
        for _ in range(20):
            off = rng.randrange(0, size + 10)
            n = rng.randrange(0, 3 * UNIT)
            assert f.pread(n, off) == data[off:off + n]
    # buffered text-free read in chunks with seek/tell
    with client.open(path, "rb") as f:
        f.seek(size // 3)
        assert f.tell() == size // 3
        assert f.read(UNIT) == data[size // 3:size // 3 + UNIT]
    assert client.read_file(path) == data


def test_data_is_striped_over_distinct_servers(client, striped) -> None:
    path = f"{striped}/big"
    client.write_file(path, os.urandom(8 * UNIT))
    layout = client.get_layout(path)
    assert layout["count"] == 4 and layout["unit"] == UNIT
    servers = [s[0] for s in layout["servers"]]
    assert len(set(servers)) == 4


def test_pwrite_patterns_match_a_local_model(client, striped) -> None:
    rng = random.Random(7)
    model = bytearray()
    path = f"{striped}/model"
    with client.open(path, "w+b") as f:
        for _ in range(60):
            off = rng.randrange(0, 10 * UNIT)
            blob = rng.randbytes(rng.randrange(1, 2 * UNIT))
            f.pwrite(blob, off)
            if len(model) < off + len(blob):
                model.extend(bytes(off + len(blob) - len(model)))
            model[off:off + len(blob)] = blob
        f.flush()
        assert f.pread(len(model) + 100, 0) == bytes(model)
    assert client.read_file(path) == bytes(model)


def test_sparse_file_reads_zeros_in_holes(client, striped) -> None:
    path = f"{striped}/sparse"
    with client.open(path, "wb") as f:
        f.pwrite(b"end", 9 * UNIT + 5)
    data = client.read_file(path)
    assert len(data) == 9 * UNIT + 8
    assert data[:-3] == bytes(9 * UNIT + 5) and data[-3:] == b"end"


def test_truncate_shrinks_then_extends_with_zeros(client, striped) -> None:
    path = f"{striped}/trunc"
    data = os.urandom(5 * UNIT)
    client.write_file(path, data)
    client.truncate(path, UNIT + 10)
    assert client.read_file(path) == data[:UNIT + 10]
    client.truncate(path, 3 * UNIT)
    assert client.read_file(path) == data[:UNIT + 10] + bytes(3 * UNIT - UNIT - 10)
    with client.open(path, "r+b") as f:
        f.truncate(5)
    assert client.read_file(path) == data[:5]


def test_append_and_exclusive_create(client, workdir) -> None:
    path = f"{workdir}/log"
    with client.open(path, "ab") as f:
        f.write(b"one\n")
    with client.open(path, "ab") as f:
        f.write(b"two\n")
    assert client.read_file(path) == b"one\ntwo\n"
    with pytest.raises(FileExistsError):
        client.open(path, "xb")
    with client.open(path, "w") as f:  # text mode through io wrappers
        f.write("héllo\n")
    with client.open(path, "r") as f:
        assert f.read() == "héllo\n"


def test_namespace_calls(client, workdir) -> None:
    d = workdir
    client.makedirs(f"{d}/a/b/c")
    client.makedirs(f"{d}/a/b/c", exist_ok=True)
    client.write_file(f"{d}/a/x", b"x")
    assert sorted(client.listdir(f"{d}/a")) == ["b", "x"]
    client.rename(f"{d}/a/x", f"{d}/a/b/y")
    assert client.listdir(f"{d}/a/b") == ["c", "y"] or sorted(client.listdir(f"{d}/a/b")) == ["c", "y"]
    client.link(f"{d}/a/b/y", f"{d}/a/z")
    assert client.stat(f"{d}/a/z").st_nlink == 2
    client.symlink("b/y", f"{d}/a/sym")
    assert client.readlink(f"{d}/a/sym") == "b/y"
    assert client.read_file(f"{d}/a/sym") == b"x"
    assert client.lstat(f"{d}/a/sym").is_symlink()
    client.chmod(f"{d}/a/z", 0o600)
    assert client.stat(f"{d}/a/z").st_mode & 0o7777 == 0o600
    client.chown(f"{d}/a/z", 1234, 5678)
    st = client.stat(f"{d}/a/z")
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    client.utime(f"{d}/a/z", ns=(1_000_000_000, 2_000_000_000))
    st = client.stat(f"{d}/a/z")
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_000, 2_000_000_000)
    client.setxattr(f"{d}/a/z", "user.k", b"v")
    assert client.getxattr(f"{d}/a/z", "user.k") == b"v"
    assert "user.k" in client.listxattr(f"{d}/a/z")
    client.removexattr(f"{d}/a/z", "user.k")
    with pytest.raises(OSError) as ei:
        client.getxattr(f"{d}/a/z", "user.k")
    assert ei.value.errno == errno.ENODATA
    with pytest.raises(OSError) as ei:
        client.rmdir(f"{d}/a")
    assert ei.value.errno == errno.ENOTEMPTY
    client.remove(f"{d}/a/z")
    assert client.stat(f"{d}/a/b/y").st_nlink == 1
    vfs = client.statvfs()
    assert vfs.f_blocks > 0 and vfs.f_namemax == 255
    entries = {e.name: e for e in client.scandir(f"{d}/a")}
    assert entries["b"].is_dir() and entries["sym"].is_symlink()


@pytest.mark.parametrize("bad,code", [
    ("a/\x00b", errno.EINVAL), ("x" * 256, errno.ENAMETOOLONG)])
def test_bad_names(client, workdir, bad: str, code: int) -> None:
    with pytest.raises(OSError) as ei:
        client.mkdir(f"{workdir}/{bad}")
    assert ei.value.errno == code


def test_path_through_a_file_is_enotdir(client, workdir) -> None:
    client.write_file(f"{workdir}/f", b"")
    with pytest.raises(OSError) as ei:
        client.stat(f"{workdir}/f/g")
    assert ei.value.errno == errno.ENOTDIR
    with pytest.raises(FileNotFoundError):
        client.stat(f"{workdir}/missing")


def test_directory_layout_is_inherited(client, workdir) -> None:
    client.set_layout(workdir, count=2, unit=128 * 1024)
    client.mkdir(f"{workdir}/sub")
    client.write_file(f"{workdir}/sub/f", b"abc")
    lay = client.get_layout(f"{workdir}/sub/f")
    assert (lay["count"], lay["unit"]) == (2, 128 * 1024)


def _objects_on_disk(cluster_dir: Path, ino: int) -> set[tuple[int, str]]:
    """(stripe, data server id) of every object file of ``ino`` in the cluster."""
    found = set()
    for ddir in (cluster_dir / "data").iterdir():
        sid = (ddir / "server.id").read_text().strip()
        found |= {(int(f.name.split(".")[1]), sid) for f in ddir.glob(f"objects/*/{ino}.*[!c]")}
    return found


def _pairs(layout: dict) -> set[tuple[int, str]]:
    return {(stripe, sid) for stripe, sids in enumerate(layout["servers"]) for sid in sids}


def test_set_layout_of_an_emptied_file_deletes_its_old_objects(client, workdir,
                                                                cluster_dir) -> None:
    """Truncated to 0, a file still has its (empty) object files; a new layout must
    queue them for deletion, but not the objects the new layout itself uses."""
    path = f"{workdir}/f"
    client.set_layout(workdir, count=4, unit=UNIT)
    client.write_file(path, os.urandom(8 * UNIT))
    ino = client.stat(path).st_ino
    old = client.get_layout(path)
    assert _objects_on_disk(cluster_dir, ino) == _pairs(old)
    client.truncate(path, 0)
    # two stripes, two copies each, on all four servers: most often some stripe keeps
    # a server of the old layout, and with it its object id there
    new = client.set_layout(path, count=2, unit=UNIT, replicas=2)
    data = os.urandom(3 * UNIT)
    client.write_file(path, data)  # before the deleter's round: it must spare these
    stale = _pairs(old) - _pairs(new)
    assert len(stale) >= 2
    deadline = time.monotonic() + 20
    while (left := _objects_on_disk(cluster_dir, ino) & stale) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"old objects never deleted: {sorted(left)}"
    assert _objects_on_disk(cluster_dir, ino) == _pairs(new)
    assert client.read_file(path) == data


def test_set_layout_of_an_open_file_is_ebusy(client, client_toml, workdir) -> None:
    """Empty but open (here by a writer whose bytes are not committed yet): the handle
    would go on writing to objects the new layout no longer reads."""
    path = f"{workdir}/w"
    client.set_layout(workdir, count=4, unit=UNIT)
    with pfs.connect(config=client_toml) as other:
        f = other.open(path, "wb")
        f.write(b"x" * (2 * UNIT))
        assert client.stat(path).st_size == 0
        with pytest.raises(OSError) as ei:
            client.set_layout(path, count=1, unit=UNIT)
        assert ei.value.errno == errno.EBUSY and "open" in str(ei.value)
        f.close()
    assert client.read_file(path) == b"x" * (2 * UNIT)
    client.truncate(path, 0)
    assert client.set_layout(path, count=1, unit=UNIT)["count"] == 1  # closed: allowed


def test_concurrent_clients(client_toml, workdir) -> None:
    """Eight clients in threads write distinct files and read each other's back."""
    blobs = {i: os.urandom(200_000 + i) for i in range(8)}
    errors: list[BaseException] = []
    written = threading.Barrier(8, timeout=120)

    def work(i: int) -> None:
        try:
            with pfs.connect(config=client_toml) as c:
                c.write_file(f"{workdir}/c{i}", blobs[i])
                written.wait()
                # close-to-open: every file was closed before the barrier, so it is whole
                other = (i + 1) % 8
                assert c.read_file(f"{workdir}/c{other}") == blobs[other]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            written.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    with pfs.connect(config=client_toml) as c:
        for i, blob in blobs.items():
            assert hashlib.sha256(c.read_file(f"{workdir}/c{i}")).digest() == hashlib.sha256(blob).digest()


def test_unlinked_open_file_stays_readable(client, workdir) -> None:
    path = f"{workdir}/ghost"
    data = os.urandom(3 * UNIT)
    client.write_file(path, data)
    with client.open(path, "rb") as f:
        client.remove(path)
        assert not client.exists(path)
        assert f.read() == data


def test_write_by_non_root_drops_setuid(client, client_toml, workdir) -> None:
    """No kernel clears the bits on the native path: the metaserver does it on commit."""
    from pfs.client.types import Cred

    path = f"{workdir}/suid"
    client.write_file(path, b"root")
    client.chown(path, 4321, 4321)
    client.chmod(path, 0o6755)
    with client.open(path, "ab") as f:  # root writing keeps them
        f.write(b"+root")
    assert client.stat(path).st_mode & 0o7777 == 0o6755
    client.chmod(workdir, 0o777)
    with pfs.connect(config=client_toml, cred=Cred(4321, 4321)) as user:
        with user.open(path, "ab") as f:
            f.write(b"+user")
    st = client.stat(path)
    assert st.st_mode & 0o7777 == 0o755 and st.st_size == len(b"root+root+user")


def test_path_based_entry_calls_check_the_way(client, workdir) -> None:
    """Entry calls send the path; the metaserver resolves it with POSIX errors."""
    client.write_file(f"{workdir}/file", b"x")
    for call, args, code in [
        (client.mkdir, (f"{workdir}/file/sub",), errno.ENOTDIR),
        (client.mkdir, (f"{workdir}/missing/sub",), errno.ENOENT),
        (client.remove, ("/",), errno.EBUSY),
        (client.rename, (f"{workdir}/file", f"{workdir}/nodir/file"), errno.ENOENT),
        (client.symlink, ("t", f"{workdir}/file"), errno.EEXIST),
        (client.link, (f"{workdir}/file", f"{workdir}/file/x"), errno.ENOTDIR),
    ]:
        with pytest.raises(OSError) as ei:
            call(*args)
        assert ei.value.errno == code, (call.__name__, args)
    client.mkdir(f"{workdir}/d/")  # a trailing slash names a directory to make
    client.rename(f"{workdir}/file", f"{workdir}/d/moved")
    assert client.listdir(f"{workdir}/d") == ["moved"]


def _drop_meta_connection(c) -> None:
    """Break the client's metaserver connection, as a network blip or a metaserver
    restart does: the metaserver forgets the handles that connection held."""
    async def drop() -> None:
        c.aio.meta.disconnect()

    c._run(drop)


def test_written_size_survives_a_lost_metaserver_connection(client, workdir) -> None:
    path = f"{workdir}/f"
    f = client.open(path, "wb")
    f.write(b"a" * 1000)
    _drop_meta_connection(client)
    f.write(b"b" * 1000)
    f.flush()  # fsync/flush/close tell the metaserver the size: by a handle it lost
    assert client.stat(path).st_size == 2000
    _drop_meta_connection(client)
    f.write(b"c" * 1000)
    f.close()
    assert client.stat(path).st_size == 3000
    assert client.read_file(path) == b"a" * 1000 + b"b" * 1000 + b"c" * 1000
    g = client.open(path, "rb")  # a handle with nothing to commit closes quietly
    _drop_meta_connection(client)
    g.close()


def test_client_close_twice_and_files_closed_after_it(client_toml, workdir) -> None:
    with pfs.connect(config=client_toml) as c:
        f = c.open(f"{workdir}/x", "wb")
        f.write(b"abc")
        c.close()  # and once more by the with statement: a no-op, as for files
    f.close()  # its handle ended with the connection: nothing to do, no error
    assert f.closed


def test_concurrent_renewals_reopen_a_lost_handle_once(client, workdir) -> None:
    """Reads in parallel on one handle whose capability is due, after the metaserver lost
    the handle: one reopen, not one per read (the others stayed open on the metaserver)."""
    import trio

    path = f"{workdir}/f"
    client.write_file(path, b"x" * 100000)
    f = client.open(path, "r+b")
    h = f.handle
    meta = client.aio.meta
    opens = []
    real_request = meta.request

    async def counting(msg):  # the open requests that reach the metaserver
        if msg.method == "open":
            opens.append(msg)
        return await real_request(msg)

    meta.request = counting
    _drop_meta_connection(client)
    h._renew_at = 0  # the capability is due: every data call renews first

    async def many() -> None:
        async with trio.open_nursery() as n:
            for i in range(8):
                n.start_soon(h.pread, 1000, i * 1000)

    client._run(many)
    del meta.request
    assert len(opens) == 1
    f.close()


def test_client_close_commits_files_left_open(client, client_toml, workdir) -> None:
    """A file written and left open when its client closes keeps what was written (the
    size never reached the metaserver: the file read back empty)."""
    with pfs.connect(config=client_toml) as c:
        f = c.open(f"{workdir}/x", "wb")
        f.write(b"abc" * 1000)
    assert client.stat(f"{workdir}/x").st_size == 3000
    assert client.read_file(f"{workdir}/x") == b"abc" * 1000
    f.close()


def test_async_client_exit_commits_files_left_open(client_toml, client, workdir) -> None:
    import trio

    from pfs.client.aio import AsyncClient

    async def main() -> None:
        async with AsyncClient.connect(config=client_toml) as ac:
            f = await ac.open(f"{workdir}/left-open", "wb")
            await f.pwrite(b"kept after exit", 0)

    trio.run(main)
    assert client.read_file(f"{workdir}/left-open") == b"kept after exit"


def test_batched_create_stat_unlink(client, client_toml, workdir) -> None:
    """create_many / stat_many / unlink_many: one request per MAX_MANY paths, each path
    failing alone with its own error; the sync and the async client."""
    from pfs.core.messages.meta import MAX_MANY

    client.write_file(f"{workdir}/taken", b"data")
    paths = [f"{workdir}/b{i}" for i in range(MAX_MANY + 5)]  # two requests
    errs = client.create_many([*paths, f"{workdir}/taken", f"{workdir}/nodir/x"], 0o640)
    assert errs[:-2] == [None] * len(paths)
    assert isinstance(errs[-2], FileExistsError) and "taken" in str(errs[-2])
    assert isinstance(errs[-1], FileNotFoundError) and "nodir" in str(errs[-1])
    assert client.read_file(f"{workdir}/taken") == b"data"  # left as it was
    got = client.stat_many([paths[0], f"{workdir}/missing", paths[-1]])
    assert got[0].st_size == 0 and got[0].st_mode & 0o777 == 0o640 & ~client.aio.umask
    assert isinstance(got[1], FileNotFoundError)
    assert got[2].st_ino != got[0].st_ino
    assert client.stat(paths[3]).st_ino == client.stat_many([paths[3]])[0].st_ino
    # a batched file opens and takes data like any other
    with client.open(paths[1], "r+b") as f:
        f.write(b"xyz")
    assert client.read_file(paths[1]) == b"xyz"
    assert client.create_many([paths[0]], exclusive=False) == [None]

    import trio

    from pfs.client.aio import AsyncClient

    async def main() -> list[OSError | None]:
        async with AsyncClient.connect(config=client_toml) as ac:
            st = await ac.stat_many(paths[:2])
            assert [getattr(s, "st_ino", None) for s in st] == [
                client.stat(paths[0]).st_ino, client.stat(paths[1]).st_ino]
            return await ac.unlink_many([*paths[:10], f"{workdir}/missing"])

    gone = trio.run(main)
    assert gone[:10] == [None] * 10 and isinstance(gone[10], FileNotFoundError)
    assert client.unlink_many(paths[10:]) == [None] * (len(paths) - 10)
    assert sorted(client.listdir(workdir)) == ["taken"]
