"""bench/common.py's results tables: a row appended to a table with other columns is one clear
error, not a malformed table (bench/master_weights.py gained a column on 2026-12-02, and its
results file holds tables of the old width)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_common", Path(__file__).resolve().parents[1] / "bench" / "common.py")
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def test_append_adds_a_row_of_the_same_width_and_refuses_another(tmp_path):
    path = str(tmp_path / "table.md")
    md = ["# t", "", "| a | b |", "|---|---|"]
    common.write_row(path, md, "| 1 | 2 |", append=True)  # no table yet: this one is written
    common.write_row(path, ["# other header"], "| 3 | 4 |", append=True)
    assert Path(path).read_text().splitlines() == [*md, "| 1 | 2 |", "| 3 | 4 |"]
    with pytest.raises(ValueError, match="has 2 columns, this row 3"):
        common.write_row(path, md, "| 5 | 6 | 7 |", append=True)
    assert Path(path).read_text().splitlines()[-1] == "| 3 | 4 |"  # nothing written
    common.write_row(path, ["| a | b | c |", "| --- | --- | --- |"], "| 5 | 6 | 7 |", append=False)
    assert Path(path).read_text().splitlines()[-1] == "| 5 | 6 | 7 |"
