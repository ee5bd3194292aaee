"""Every committed claims report renders again from the data committed beside it.

``docs/results/<name>.md`` is rendered by ``privbench report`` from a results store; ``docs/results/data/<name>/``,
where it exists, is that store's export (``privbench results export``). For each such pair the export is loaded into
a temporary store and the report rendered from it, with the profile the report names in its title; the Markdown
must be the committed file byte for byte. ``tasks.report`` writes no time of rendering and no commit of the
renderer (the commits and times it shows are the runs'), so no line is ignored as volatile. The figures are not
drawn (seconds per report): the comparison stops at the committed report's ``## Figures`` section, the last, whose
PNGs must exist beside it. Until a report has its data the check runs on a tiny store made here: render, export,
render from the export, restore, export again, render again.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest

from storage.archive import MANIFEST, export_store, restore_store, restored
from storage.db import dispose_engine

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
_TITLE = re.compile(r"# privbench report: (?:profile `(?P<profile>[^`]+)`|every profile)$")


def committed_reports(results: Path) -> list[tuple[Path, Path]]:
    """``(report, export folder)`` for every ``<name>.md`` in ``results`` with an export in ``data/<name>/``."""
    data = results / "data"
    return [(md, data / md.stem) for md in sorted(results.glob("*.md")) if (data / md.stem / MANIFEST).is_file()]


def report_profile(markdown: str) -> str | None:
    """The profile a report was rendered for, from its title (None: every profile)."""
    match = _TITLE.match(markdown.splitlines()[0] if markdown else "")
    if match is None:
        raise AssertionError(
            f"not a claims report (its first line is not `# privbench report: ...`): {markdown[:80]!r}"
        )
    return match["profile"]


def rerender(report: Path, data: Path, out_dir: Path) -> str:
    """The report rendered again from ``data`` into ``out_dir``, without figures."""
    from tasks.report import render_report

    profile = report_profile(report.read_text())
    with restored(data) as url:
        return render_report(out_dir / report.name, profile=profile, db_url=url, figures=False).path.read_text()


def without_figures(report: Path) -> str:
    """The committed report up to its ``## Figures`` section, as a rendering without figures writes it; raises
    AssertionError naming a figure it links that is not beside it."""
    text = report.read_text()
    head, found, figures = text.partition("\n## Figures\n")
    if not found:
        return text
    for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", figures):
        assert (report.parent / link).is_file(), f"{report.name} links the figure {link}, which is not committed"
    return head.rstrip() + "\n"


def _diff(expected: str, got: str, name: str) -> str:
    lines = difflib.unified_diff(expected.splitlines(), got.splitlines(), f"committed {name}", "rendered", lineterm="")
    return "\n".join(list(lines)[:40])


@pytest.mark.parametrize("report,data", committed_reports(RESULTS), ids=lambda p: p.name)
def test_a_committed_report_renders_again_from_its_data(report: Path, data: Path, tmp_path: Path) -> None:
    expected = without_figures(report)
    got = rerender(report, data, tmp_path)
    assert got == expected, _diff(expected, got, report.name)


def test_the_check_on_a_tiny_store(home: Path, tmp_path: Path) -> None:
    from tasks.report import render_report
    from tests.storage.test_archive import fill_tiny_store

    fill_tiny_store()
    results = tmp_path / "docs" / "results"
    committed = render_report(results / "tiny.md", profile="tiny", figures=False).path
    export_store(results / "data" / "tiny")
    (results / "notes.md").write_text("# notes\n")  # a page without data is not checked
    assert committed_reports(results) == [(committed, results / "data" / "tiny")]
    expected = without_figures(committed)
    assert (
        expected == committed.read_text()
        and report_profile(expected) == "tiny"
        and "## Where these numbers come from" in expected
    )
    got = rerender(committed, results / "data" / "tiny", tmp_path / "first")
    assert got == expected, _diff(expected, got, committed.name)

    # the store restored from the export exports the same files and renders the same report
    url = f"sqlite:///{tmp_path / 'restored.db'}"
    restore_store(results / "data" / "tiny", url)
    export_store(tmp_path / "again", db_url=url)
    dispose_engine(url)
    for path in sorted((results / "data" / "tiny").iterdir()):
        assert (tmp_path / "again" / path.name).read_bytes() == path.read_bytes(), path.name
    got = rerender(committed, tmp_path / "again", tmp_path / "second")
    assert got == expected, _diff(expected, got, committed.name)

    # a committed report that does not say what its data says fails the comparison
    changed = re.sub(r"Verdicts: (\d+)", lambda m: f"Verdicts: {int(m[1]) + 1}", expected, count=1)
    assert changed != expected and got != changed
    figured = results / "figured.md"
    figured.write_text(f"{expected}\n## Figures\n\n![a](figured/a.png)\n")
    with pytest.raises(AssertionError, match="links the figure figured/a.png, which is not committed"):
        without_figures(figured)
    (results / "figured").mkdir()
    (results / "figured" / "a.png").write_bytes(b"")
    assert without_figures(figured) == expected
