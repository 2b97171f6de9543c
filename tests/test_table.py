"""Tables fit in 100 columns: wide ones in parts that repeat the key columns, long texts wrapped in their cells."""

import json

from nvrx_lab.observe.report import build_report
from nvrx_lab.observe.table import WIDTH, format_table, report


def wide_rows():
    rows = [{"ranks": n, "protocol": p, **{f"figure_number_{i}": n * i + 0.5 for i in range(12)}}
            for n in (8, 1024) for p in ("new", "legacy")]
    rows[1]["phases"] = {"detect": 2.7100815773010254, "pod": 20.0, "start": 8.22938060760498, "restore": 0.5}
    rows[1]["why"] = "a long sentence that says what must hold, longer than any cell may be on one line of the table"
    return rows


def test_a_wide_table_is_printed_in_parts_each_naming_its_rows():
    rows = wide_rows()
    text = format_table(rows)
    lines = text.splitlines()
    assert max(map(len, lines)) <= WIDTH, max(lines, key=len)
    parts = text.split("\n\n")
    assert len(parts) > 2
    for part in parts:
        head = part.splitlines()[0].split()
        assert head[:2] == ["ranks", "protocol"], head  # every part names the rows by their key columns
    shown = {c for part in parts for c in part.splitlines()[0].split()}
    assert shown == set(rows[1]), set(rows[1]) - shown  # every column, once the parts are read together
    assert "1.024e+04" in text and "detect 2.71, pod 20, start 8.229" in text  # numbers as numbers, dicts readable
    assert not any(rows[1]["why"] in ln for ln in lines) and "the table" in text  # wrapped, all of it


def test_a_column_empty_everywhere_is_left_out_and_a_part_shows_only_rows_with_values():
    rows = [{"ranks": 8, "protocol": "new", "restart_s": 0.05, "quorum_ms": ""},
            {"ranks": 1024, "protocol": "replicas 128x8", "quorum_ms": 56.2}]
    text = format_table(rows, ["ranks", "protocol", "restart_s", "quorum_ms", "error"], width=40)
    assert "error" not in text
    first, second = text.split("\n\n")
    assert "replicas" not in first and "56.2" in second and "new" not in second, text


def test_the_report_shows_the_benchmarks_own_columns_within_100(tmp_path, capsys):
    (tmp_path / "bench").mkdir()
    rows = wide_rows()
    report("wide", rows, tmp_path / "bench" / "wide.json", "python -m nvrx_lab.bench wide",
           columns=["ranks", "protocol", "figure_number_1", "phases"])
    assert json.loads((tmp_path / "bench" / "wide.json").read_text())["columns"][-1] == "phases"
    md = build_report(tmp_path)
    table = md[md.index("```") + 3:md.rindex("```")]
    assert "figure_number_1" in table and "figure_number_2" not in table
    assert max(map(len, table.splitlines())) <= WIDTH
    assert max(map(len, capsys.readouterr().out.splitlines())) <= WIDTH
