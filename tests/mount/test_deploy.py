"""deploy/: the example configs load, and the fstab helper mounts like mount(8) would."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pfs.core.config import ClientConfig, DataConfig, MetaConfig, load

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@pytest.mark.parametrize("name,cls", [("meta.toml", MetaConfig), ("data.toml", DataConfig),
                                      ("client.toml", ClientConfig)])
def test_example_configs_load(name: str, cls: type) -> None:
    cfg: object = load(cls, DEPLOY / "etc" / name)  # unknown keys or wrong types would raise
    assert isinstance(cfg, cls)


def test_systemd_units_run_pfs_subcommands() -> None:
    for unit in (DEPLOY / "systemd").glob("*.service"):
        text = unit.read_text()
        line = next(ln for ln in text.splitlines() if ln.startswith("ExecStart="))
        assert "pfs " in line and ("--config /etc/pfs/" in line), unit.name


def test_the_node_tier_mount_unit_is_a_large_folio_tmpfs_where_its_name_says() -> None:
    units = list((DEPLOY / "systemd").glob("*.mount"))
    assert units
    for unit in units:
        keys = dict(ln.split("=", 1) for ln in unit.read_text().splitlines()
                    if "=" in ln and not ln.startswith("#"))
        # systemd requires a mount unit's name to be its escaped mount point
        assert unit.stem == keys["Where"].strip("/").replace("-", "\\x2d").replace("/", "-")
        assert keys["Type"] == "tmpfs" and "huge=within_size" in keys["Options"].split(",")


def test_fstab_helper_mounts(client_toml: Path) -> None:
    from tests.fuse_fixtures import fuse_usable

    if (why := fuse_usable()) is not None:
        pytest.skip(why)
    mnt = Path(tempfile.mkdtemp(prefix="pfs-fstab-"))
    pfs_bin = shutil.which("pfs", path=os.path.dirname(sys.executable))
    assert pfs_bin, "the pfs console script is next to the interpreter"
    env = dict(os.environ, PFS=pfs_bin)
    try:
        # what mount(8) runs for: CONFIG MNT fuse.pfs allow_other,_netdev,rw 0 0
        r = subprocess.run([str(DEPLOY / "mount.fuse.pfs"), str(client_toml), str(mnt),
                            "-o", "rw,allow_other,_netdev"], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        (mnt / "via-fstab").write_bytes(b"hello")
        assert (mnt / "via-fstab").read_bytes() == b"hello"
        os.unlink(mnt / "via-fstab")
    finally:
        subprocess.run([pfs_bin, "umount", str(mnt)], capture_output=True, timeout=60)
        os.rmdir(mnt)
