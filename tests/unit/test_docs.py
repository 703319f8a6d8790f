"""docs/architecture.md keeps one line per module: a module missing from its table fails."""
from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# folders whose modules one row of the table describes together
FOLDER_ROWS = ("pfs/bench/", "pfs/core/messages/")


def test_every_module_has_its_line_in_architecture_md() -> None:
    table = (ROOT / "docs" / "architecture.md").read_text()
    files = subprocess.run(["git", "ls-files", "pfs", "metaserver", "dataserver", "fuse"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    missing = [f for f in files
               if f.endswith(".py") and not f.endswith("__init__.py")
               and not f.startswith(FOLDER_ROWS) and f"`{f}`" not in table]
    assert missing == [], "add a line for each to the module table of docs/architecture.md"
    for row in FOLDER_ROWS:
        assert f"`{row}`" in table
