"""``pfs bench io500-peers``: its targets and its side-by-side table (the harness itself
is not installed in CI; its runs are parsed by the tested ``io500ref.parse_output``)."""
from __future__ import annotations

from pathlib import Path

import pytest

from pfs.bench import io500peers, io500ref


def _parsed(total: float, find: float) -> io500ref.Parsed:
    return io500ref.Parsed(phases={"find": (find, 1.0, True)}, bw=1.0, md=find, total=total,
                           valid=True)


def test_targets_need_label_and_an_existing_directory(tmp_path: Path) -> None:
    assert io500peers._targets([f"a={tmp_path}"]) == [("a", tmp_path)]
    for bad in ["nolabel", f"={tmp_path}", f"a={tmp_path / 'missing'}"]:
        with pytest.raises(SystemExit):
            io500peers._targets([bad])
    with pytest.raises(SystemExit, match="each LABEL once"):
        io500peers._targets([f"a={tmp_path}", f"a={tmp_path}"])


def test_table_gives_medians_and_ratios_to_the_first() -> None:
    runs = {"pfs": [_parsed(1.0, 10.0), _parsed(3.0, 30.0), _parsed(2.0, 20.0)],
            "mfs": [_parsed(4.0, 5.0), _parsed(4.0, 5.0), _parsed(8.0, 5.0)]}
    meds = {k: io500ref.medians(v) for k, v in runs.items()}
    lines = io500peers.table(["pfs", "mfs"], meds, runs)
    find = next(line for line in lines if line.startswith("find"))
    assert find.split()[1:] == ["20.0000", "5.0000", "0.25"]
    total = next(line for line in lines if line.startswith("score-total"))
    assert total.split()[1:] == ["2.0000", "4.0000", "2.00"]
    assert "medians of 3 runs" in lines[0]


def test_no_harness_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(io500ref.ENV_REFERENCE, raising=False)
    with pytest.raises(SystemExit, match="no reference harness"):
        io500peers.main([f"a={tmp_path}"])
