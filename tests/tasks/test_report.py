"""The report's figures folder (``tasks.report``): an earlier report's figures are replaced, anything else in the
folder is never deleted."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import ConfigError
from tasks.report import render_report


def test_a_folder_of_other_files_is_refused_and_kept(home: Path, tmp_path: Path) -> None:
    export = tmp_path / "reference"  # e.g. a store export, then `privbench report --out reference.md`
    export.mkdir()
    (export / "runs.csv.gz").write_bytes(b"data")
    (export / "old-figure.png").write_bytes(b"png")
    with pytest.raises(ConfigError, match=r"holds files a report does not write \(runs\.csv\.gz\)"):
        render_report(tmp_path / "reference.md", profile="tiny")
    assert (export / "runs.csv.gz").read_bytes() == b"data" and (export / "old-figure.png").exists()
    assert not (tmp_path / "reference.md").exists()


def test_an_earlier_reports_figures_are_replaced(home: Path, tmp_path: Path) -> None:
    figures = tmp_path / "report"
    figures.mkdir()
    (figures / "stale.png").write_bytes(b"png")
    done = render_report(tmp_path / "report.md", profile="tiny")
    assert done.path.exists() and figures.is_dir() and not (figures / "stale.png").exists()
