"""C helpers compiled at first use with the system's compiler (the io500 loops, the
folding CRC32C): where they are kept, and the build."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pfs"


def build(src: Path, out: Path, flags: tuple[str, ...] = ()) -> None:
    """Compile ``src`` into the shared library ``out`` (written beside it, then renamed:
    processes that build at once each get a whole file)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise OSError("no C compiler (cc, gcc or $CC)")
    out.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, "-O2", "-shared", "-fPIC", *flags, "-o", tmp, str(src)],
                              capture_output=True, text=True, timeout=120, check=False)
        if proc.returncode != 0:
            raise OSError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
