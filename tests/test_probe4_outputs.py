"""Issue 44's output findings, with their payloads: `mrl report` wrote report.md, report.html, report.png and
report_data/*.csv through symlinks planted in a run dir (a link to ~/.bashrc got a metric key that runs a command at
the next shell), metric keys and labels landed in the CSVs as formulas (`=HYPERLINK(...)`, `=cmd|' /C calc'!A0`,
`@SUM(...)`) and in report.md as raw HTML and extra lines, and a lineage.json of `Infinity` or deep nesting was a
traceback."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mrl.core.config import UserError
from mrl.runs.report import make_report

KEYS = {"=cmd|' /C calc'!A0": 1.0, '=HYPERLINK("http://x.example/?leak","click")': 2.0,
        "@SUM(1+1)*cmd|' /C calc'!A0": 3.0, "+1+cmd": 4.0, "-2+cmd": 5.0, "\tTAB": 6.0}
CHANNEL = "x|y\n| injected | row |\n<img src=x onerror=alert(1)>"


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": s, "reward/total/mean": -0.5 * s, f"reward/{CHANNEL}/mean": -0.25, **KEYS} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run


@pytest.mark.parametrize("name", ["report.md", "report.html", "report.png", "report_data", "report_data/run.csv"])
def test_probe4_report_never_writes_through_a_planted_link(name, tmp_path):
    run = _run(tmp_path)
    victim = tmp_path / "victim"  # ~/.bashrc, ~/.ssh/authorized_keys, ~/.ssh/
    victim.mkdir() if name == "report_data" else victim.write_text("# the user's own file\n")
    if "/" in name:
        (run / "report_data").mkdir()
    os.symlink(victim, run / name)
    with pytest.raises(UserError) as err:
        make_report([run])
    assert "\n" not in str(err.value) and f"{run / name} is a symlink" in str(err.value)
    assert (list(victim.iterdir()) == [] if victim.is_dir() else victim.read_text() == "# the user's own file\n")


def test_probe4_cli_report_refuses_a_link_in_one_line(tmp_path):
    run = _run(tmp_path)
    (tmp_path / "bashrc").write_text("# mine\n")
    os.symlink(tmp_path / "bashrc", run / "report.md")
    result = subprocess.run([sys.executable, "-m", "mrl.cli", "report", str(run)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "is a symlink" in result.stderr, result
    assert (tmp_path / "bashrc").read_text() == "# mine\n"


def test_probe4_csv_cells_that_start_a_formula_are_text(tmp_path):
    run = _run(tmp_path)
    make_report([run])
    (path,) = (run / "report_data").glob("*.csv")
    header, *rows = list(csv.reader(path.open(newline="")))
    assert [h for h in header if h.lstrip("'") in KEYS] == ["'" + k for k in KEYS]  # every one neutralised
    assert not [cell for row in [header, *rows] for cell in row if cell[:1] in "=+-@\t\r" and not _number(cell)]
    total = header.index("reward/total/mean")
    assert [row[total] for row in rows] == ["-0.5", "-1.0"]  # negative numbers stay numbers


def _number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def test_probe4_labels_and_keys_are_escaped_in_report_md(tmp_path):
    run = _run(tmp_path)
    _, table = make_report([run])
    text = (run / "report.md").read_text()
    assert text == table + "\n" and "<img" not in text and "&lt;img src=x onerror=alert(1)&gt;" in text
    header = next(line for line in text.splitlines() if line.startswith("| run"))
    # one row of cells: the channel's `|` escaped, its newlines spaces
    assert "x\\|y \\| injected \\| row \\| &lt;img" in header
    assert len([line for line in text.splitlines() if line.startswith("|")]) == 3  # header, rule, one run


@pytest.mark.parametrize("lineage", ['{"source_run": "/x", "step": Infinity}', "[" * 100_000 + "]" * 100_000,
                                     '{"source_run": "/x", "step": NaN}', '{"source_run": ["/x"], "step": 1}'])
def test_probe4_a_hostile_lineage_is_one_warning_and_the_report_is_drawn(lineage, tmp_path, capsys):
    run = _run(tmp_path)
    (run / "lineage.json").write_text(lineage)
    make_report([run])
    err = capsys.readouterr().err
    assert "lineage.json is unreadable" in err and (run / "report.html").exists()
