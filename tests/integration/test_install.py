"""pfs installs no top-level name but `pfs`, so it shares an environment
with fusepy (whose import name is `fuse`). A fresh virtualenv outside the checkout,
`pip install <checkout> fusepy` from PyPI (the wheel cache makes reruns quick)."""
from __future__ import annotations

import ctypes.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _copy_checkout(dst: Path) -> None:
    """The tracked files (links kept): pip builds in the tree, so not in the checkout."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src, out = ROOT / rel, dst / rel
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the work tree
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            out.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, out)


def _run(argv: list[str], cwd: Path, timeout: float = 600) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"{argv}: {r.stdout}{r.stderr}"
    return r.stdout


def test_pip_install_with_fusepy_in_a_fresh_environment(tmp_path: Path) -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout")
    src = tmp_path / "src"
    _copy_checkout(src)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    py = str(venv / "bin" / "python")
    _run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", str(src),
          "fusepy"], tmp_path)
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     tmp_path).strip())
    for name in ("metaserver", "dataserver", "fuse"):
        assert not (site / name).exists(), f"pfs installed a top-level {name}/"
    # ours under pfs, fusepy's at top level, from the environment and not the checkout
    out = _run([py, "-c", "import pfs.fuse, pfs.metaserver, pfs.dataserver, "
                "importlib.util as u; print(pfs.fuse.__file__); print(u.find_spec('fuse').origin)"],
               tmp_path).split()
    assert out[0].startswith(str(site)) and out[1] == str(site / "fuse.py"), out
    # fusepy loads libfuse 2 when imported; where only FUSE 3 is installed it says so
    probe = ("import fuse; print(fuse.FUSE.__module__)" if ctypes.util.find_library("fuse")
             else "try:\n import fuse\nexcept EnvironmentError as e:\n print('fuse', e)")
    assert _run([py, "-c", probe], tmp_path).startswith("fuse")
    assert "usage: pfs" in _run([str(venv / "bin" / "pfs"), "--help"], tmp_path)
