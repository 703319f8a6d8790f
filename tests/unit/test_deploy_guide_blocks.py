"""deploy/README.md parses as the deployment test reads it (tests/deploy_guide.py): every
sh block is marked with its hosts, and the units its services blocks start exist."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy_guide import (
    GuideError,
    assigned_names,
    blocks,
    load_unit,
    started_units,
    unescape_path,
)

ROOT = Path(__file__).resolve().parents[2]
HOSTS = ("meta", "data1", "data2", "client1", "client2")


def test_every_block_of_the_guide_is_marked_and_its_units_exist() -> None:
    guide = blocks(ROOT / "deploy" / "README.md", HOSTS)
    (variables,) = [b for b in guide if b.step == "variables"]
    assert {"META_ADDR", "PFS_PREFIX", "PFS_ETC", "PFS_MNT"} <= assigned_names(variables)
    assert [b for b in guide if b.step == "install"]
    for b in guide:
        if b.step == "services":
            assert "systemctl enable --now" in b.text
            for ln in b.text.splitlines():
                if "deploy/systemd/" in ln:
                    name = ln.split("deploy/systemd/")[1].split('"')[0]
                    assert (ROOT / "deploy" / "systemd" / name).is_file(), name


def test_an_unmarked_block_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "g.md"
    p.write_text("text\n\n```sh\necho hi\n```\n")
    with pytest.raises(GuideError, match="without a"):
        blocks(p, HOSTS)
    p.write_text('<!-- run on="meta nowhere" -->\n```sh\necho hi\n```\n')
    with pytest.raises(GuideError, match="unknown hosts"):
        blocks(p, HOSTS)
    p.write_text('<!-- run on="all" as="loader" -->\n```sh\necho hi\n```\n')
    (b,) = blocks(p, HOSTS)
    assert b.hosts == HOSTS and b.as_user == "loader" and b.text == "echo hi\n"


def test_units_and_their_instances() -> None:
    calls = "daemon-reload\x1f\nenable\x1f--now\x1fpfs-mount@tmp-a\\x2db-mnt\x1f\n"
    (unit,) = started_units(calls)
    assert unit == "pfs-mount@tmp-a\\x2db-mnt" and unescape_path("tmp-a\\x2db-mnt") == "tmp/a-b/mnt"
    u = load_unit(ROOT / "deploy" / "systemd", unit, {"/opt/pfs": "/P", "/etc/pfs": "/E"})
    assert u.exec_start[:4] == ["/P/.venv/bin/pfs", "mount", "--config", "/E/client.toml"]
    assert u.exec_start[4] == "/tmp/a-b/mnt" and u.exec_start_pre == [["/bin/mkdir", "-p",
                                                                      "/tmp/a-b/mnt"]]
    d = load_unit(ROOT / "deploy" / "systemd", "pfs-data@0", {"/etc/pfs": "/E"})
    assert "/E/data-0.toml" in d.exec_start
