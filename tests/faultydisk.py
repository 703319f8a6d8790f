"""Disks whose reads can be made to fail with EIO, for fault tests: image files served
by a small FUSE filesystem (direct I/O: every read reaches it) to loop devices, with an
ext4 on each, mounted where a data server keeps its data.

Device-mapper's ``error`` target does the same where the kernel has device-mapper;
this one needs only FUSE and loop devices. Byte ranges of an image listed in its
``NAME.fail`` file (``lo hi`` per line; ``0 -1``: all of it) fail their reads, at once:
a page the kernel reads from the disk then gets EIO (a file read) or SIGBUS (a touch
of a mapping).

Run as ``python -m tests.faultydisk IMAGES MOUNTPOINT`` (serves until unmounted).
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = 1


def _ranges(path: str) -> list[tuple[int, int]]:
    try:
        with open(path) as f:
            out = []
            for line in f:
                lo, hi = (int(x) for x in line.split())
                out.append((lo, hi if hi >= 0 else 1 << 62))
            return out
    except FileNotFoundError:
        return []


def serve(images: str, mountpoint: str) -> None:
    import pyfuse3
    import trio

    names = sorted(n for n in os.listdir(images) if n.endswith(".img"))
    inos = {n.encode(): i + 2 for i, n in enumerate(names)}
    paths = {i + 2: os.path.join(images, n) for i, n in enumerate(names)}

    class Fs(pyfuse3.Operations):  # type: ignore[misc]
        def _attr(self, ino: int) -> pyfuse3.EntryAttributes:
            a = pyfuse3.EntryAttributes()
            if ino == ROOT:
                a.st_mode, a.st_size = stat.S_IFDIR | 0o755, 0
            else:
                a.st_mode, a.st_size = stat.S_IFREG | 0o644, os.stat(paths[ino]).st_size
            a.st_ino, a.st_nlink = ino, 1
            a.attr_timeout = a.entry_timeout = 0
            return a

        async def getattr(self, ino: int, ctx: object = None) -> pyfuse3.EntryAttributes:
            return self._attr(ino)

        async def lookup(
            self, parent: int, name: bytes, ctx: object = None
        ) -> pyfuse3.EntryAttributes:
            if parent != ROOT or name not in inos:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._attr(inos[name])

        async def opendir(self, ino: int, ctx: object) -> int:
            return ino

        async def readdir(self, fh: int, start: int, token: pyfuse3.ReaddirToken) -> None:
            for i, n in enumerate(inos):
                if i >= start and not pyfuse3.readdir_reply(token, n, self._attr(inos[n]), i + 1):
                    return

        async def open(self, ino: int, flags: int, ctx: object) -> pyfuse3.FileInfo:
            fd = os.open(paths[ino], os.O_RDWR)
            return pyfuse3.FileInfo(fh=fd, direct_io=True, keep_cache=False)

        async def read(self, fh: int, off: int, size: int) -> bytes:
            for lo, hi in _ranges(_fail_path(os.readlink(f"/proc/self/fd/{fh}"))):
                if off < hi and off + size > lo:
                    raise pyfuse3.FUSEError(errno.EIO)
            return os.pread(fh, size, off)

        async def write(self, fh: int, off: int, buf: bytes) -> int:
            return os.pwrite(fh, buf, off)

        async def fsync(self, fh: int, datasync: bool) -> None:
            os.fsync(fh)

        async def release(self, fh: int) -> None:
            os.close(fh)

    opts = set(pyfuse3.default_options)
    opts.discard("default_permissions")
    opts |= {"fsname=pfs-faultydisk", "allow_other"}
    pyfuse3.init(Fs(), mountpoint, opts)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=False)


def _fail_path(image: str) -> str:
    return image[: -len(".img")] + ".fail"


class Disk:
    """One faulty disk: its image, loop device and the ext4 mounted at ``mount``."""

    def __init__(self, image: Path, mount: Path) -> None:
        self.image, self.mount = image, mount
        self.loop = ""

    def fail(self, ranges: list[tuple[int, int]]) -> None:
        """Reads of these byte ranges of the disk fail from now on ([] heals it)."""
        Path(_fail_path(str(self.image))).write_text("".join(f"{lo} {hi}\n" for lo, hi in ranges))

    def extents(self, path: Path, off: int = 0, n: int = -1) -> list[tuple[int, int]]:
        """The byte ranges of the disk that hold ``n`` bytes of ``path`` at ``off``
        (all of it by default; FIEMAP: its data must be on the disk, synced)."""
        out = subprocess.run(
            ["filefrag", "-e", "-b1", str(path)], capture_output=True, text=True, check=True
        ).stdout
        end = os.stat(path).st_size if n < 0 else off + n
        got = []
        for line in out.splitlines():
            parts = line.replace(":", " ").replace("..", " ").split()
            if len(parts) >= 6 and parts[0].isdigit():
                lo, hi, phys = int(parts[1]), int(parts[2]) + 1, int(parts[3])
                a, b = max(lo, off), min(hi, end)
                if a < b:
                    got.append((phys + a - lo, phys + b - lo))
        if not got:
            raise AssertionError(f"no extents for {path} [{off}, {end}): {out}")
        return got


@contextmanager
def faulty_disks(d: Path, mounts: list[Path], size: int = 256 << 20) -> Iterator[list[Disk]]:
    """Mount a fresh ext4 of ``size`` bytes on a faulty disk at each of ``mounts``."""
    images, fusedir = d / "images", d / "fuse"
    images.mkdir(parents=True)
    fusedir.mkdir()
    disks = []
    for i, m in enumerate(mounts):
        img = images / f"disk{i}.img"
        with open(img, "wb") as f:
            f.truncate(size)
        disks.append(Disk(img, m))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.faultydisk", str(images), str(fusedir)],
        cwd=Path(__file__).parents[1],
    )
    try:
        for _ in range(200):
            if os.path.ismount(fusedir):
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the faulty-disk FUSE filesystem did not mount")
        for disk in disks:
            disk.loop = subprocess.run(
                ["losetup", "-f", "--show", str(fusedir / disk.image.name)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            subprocess.run(
                ["mkfs.ext4", "-q", "-F", "-E", "nodiscard,lazy_itable_init=0", disk.loop],
                check=True,
                capture_output=True,
            )
            disk.mount.mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", disk.loop, str(disk.mount)], check=True)
        yield disks
    finally:
        for disk in disks:
            disk.fail([])
            if disk.mount and os.path.ismount(disk.mount):
                subprocess.run(["umount", "-l", str(disk.mount)], check=False)
            if disk.loop:
                subprocess.run(["losetup", "-d", disk.loop], check=False)
        subprocess.run(["fusermount", "-u", "-z", str(fusedir)], check=False)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
