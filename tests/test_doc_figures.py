"""Every measured figure the hand-written documentation quotes is one that a generated report holds.

The reports ``privbench report`` writes under ``docs/results/`` (a page there that starts with the report's header,
``# privbench report: ``) are the one home of measured figures: README.md and the other pages link to them instead
of copying their numbers, which go stale the day a profile is measured again. This module scans README.md and
``docs/**/*.md``, less the reports and the archive (``docs/results/archive/``: hand-kept measurements of a named
commit and machine, which no claim reads), for figure-like tokens and fails naming the file, the line and each
token that no report contains.

Figure-like tokens (``PATTERNS``):

* ``duration``: ``12 min 32 s``, ``1 h 46 min``, ``1 h 46 min 15 s``, ``1 h 15``;
* ``multiple``: a decimal followed by ``x``: ``2.35x``, ``1.12x``;
* ``percent``: a signed decimal percentage: ``+31.4%``, ``-7.0%``;
* ``decimal``: a decimal with three or more significant digits in prose (outside code spans and code blocks,
  where configuration values and versions live; not part of a dotted version such as ``2.13.0``): ``0.386``,
  ``113.7``, ``0.0569``, ``14.8`` (of ``14.8%``).

A token is found in a report when its number occurs there between number boundaries (``0.38`` is not in
``0.386``), durations with the same hours, minutes and seconds (``1 h 46 min`` is in ``1 h 46 min 15 s``); the
sign and a multiple's ``x`` may differ (the benchmark section writes ratios as bare numbers).

What is not a measurement (a paper's own value, a configuration value, the bound of a rule, a budget) is allowed
by a marker on its line that names each such token and says why, e.g.

    DPFormer reports 4.57% to 7.99% NDCG@10 <!-- not a measurement: 4.57; 7.99 (DPFormer's Table 1) -->

A marker that names a token its line does not hold fails too, so the allowances stay as small as the docs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REPORT_HEADER = "# privbench report: "
ARCHIVE = Path("docs/results/archive")

PATTERNS: dict[str, re.Pattern[str]] = {
    "duration": re.compile(r"(?<![\w.])(?:\d+ h \d+(?: min(?: \d+ s)?)?|\d+ min \d+ s)(?!\w|\.\d)"),
    "multiple": re.compile(r"(?<![\w.])\d+\.\d+x(?!\w)"),
    "percent": re.compile(r"(?<![\w.])[+-]\d+\.\d+ ?%"),
    "decimal": re.compile(r"(?<![\w.])(?<!\d,)\d+\.\d+(?!\w|\.\d)"),
}
MARKER = re.compile(r"<!--\s*not a measurement:\s*(?P<tokens>[^()]*?)\s*\((?P<why>[^)]+)\)\s*-->")
COMMENT = re.compile(r"<!--.*?-->")
CODE_SPAN = re.compile(r"`[^`]*`")
MINUSES = str.maketrans({"\u2212": "-", "\u2013": "-"})


@dataclass(frozen=True)
class Finding:
    """A token at ``path:line`` (relative to the scanned root) that no report holds, or an allowance no token uses."""

    path: str
    line: int
    token: str
    problem: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.token!r} {self.problem}"


def is_report(path: Path) -> bool:
    """A page ``privbench report`` rendered: it starts with the report's header."""
    with path.open(encoding="utf-8") as fh:
        return fh.readline().startswith(REPORT_HEADER)


def reports(root: Path) -> list[Path]:
    """The generated reports: ``docs/results/<profile>.md`` and the siblings rendered with ``--out``."""
    return sorted(p for p in (root / "docs" / "results").glob("*.md") if is_report(p))


def scanned_docs(root: Path) -> list[Path]:
    """README.md and every page under docs/ except the generated reports and the archive."""
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    archive = root / ARCHIVE
    return [p for p in pages if p.is_file() and archive not in p.parents and not is_report(p)]


def significant_digits(number: str) -> int:
    return len(number.replace(".", "").lstrip("0"))


def figures(line: str, *, code: bool = False) -> list[tuple[str, str]]:
    """The figure-like tokens of one line as ``(kind, token)``; ``code``: the line is in a code block, where only
    durations, multiples and signed percentages count. Markers and other HTML comments are not read."""
    line = COMMENT.sub(" ", line).translate(MINUSES)
    prose = CODE_SPAN.sub(" ", line)
    found: list[tuple[str, str]] = []
    taken: list[tuple[int, int]] = []  # spans of longer tokens, so a multiple's number is not also a decimal
    for kind, pattern in PATTERNS.items():
        text = line if kind != "decimal" else prose
        if kind == "decimal" and code:
            continue
        for m in pattern.finditer(text):
            if kind == "decimal" and (significant_digits(m.group()) < 3 or any(a <= m.start() < b for a, b in taken)):
                continue
            if kind in ("multiple", "percent"):
                taken.append(m.span())
            found.append((kind, m.group()))
    return found


def allowances(line: str) -> tuple[set[str], list[str]]:
    """The tokens a ``<!-- not a measurement: A; B (why) -->`` marker on the line allows, and the ones it names
    that are not well formed (a marker must say why)."""
    allowed: set[str] = set()
    bad: list[str] = []
    for comment in COMMENT.findall(line):
        if "not a measurement" not in comment:
            continue
        m = MARKER.fullmatch(comment)
        if not m:
            bad.append(comment)
            continue
        allowed |= {t.strip().translate(MINUSES) for t in m["tokens"].split(";") if t.strip()}
    return allowed, bad


def _number(token: str) -> str:
    return re.search(r"\d+(?:\.\d+)?", token).group()


def in_reports(kind: str, token: str, text: str) -> bool:
    """Whether the reports' ``text`` holds ``token`` (see the module docstring for what counts as the same)."""
    if kind == "duration":
        parts = [f"0*{n}" for n in re.findall(r"\d+", token)]
        units = re.findall(r"[a-z]+", token)
        body = "".join(f"{n} {u} " for n, u in zip(parts, units, strict=False))
        body += parts[-1] if len(parts) > len(units) else ""
        pattern = r"(?<![\d.])" + body.rstrip() + r"(?!\d)"
    else:
        pattern = r"(?<![\d.])" + re.escape(_number(token)) + (r" ?%" if kind == "percent" else r"(?![\d])")
    return re.search(pattern, text) is not None


def unsourced(root: Path) -> list[Finding]:
    """Every figure-like token of the scanned docs under ``root`` that no generated report holds, and every
    allowance that is malformed or names a token its line lacks."""
    found = reports(root)
    if not found:
        raise FileNotFoundError(
            f"no generated report under {root / 'docs' / 'results'}: render one with privbench report"
        )
    text = "\n".join(p.read_text(encoding="utf-8") for p in found).translate(MINUSES)
    findings: list[Finding] = []
    for page in scanned_docs(root):
        rel = page.relative_to(root).as_posix()
        fenced = False
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            code = fenced or line.startswith(("    ", "\t"))
            allowed, bad = allowances(line)
            findings += [
                Finding(rel, number, b, "is a malformed marker: <!-- not a measurement: A; B (why) -->") for b in bad
            ]
            tokens = figures(line, code=code)
            for kind, token in tokens:
                if token not in allowed and not in_reports(kind, token, text):
                    findings.append(
                        Finding(rel, number, token, f"({kind}) is in no generated report: link to the report instead")
                    )
            held = {t for _, t in tokens}
            findings += [Finding(rel, number, t, "is allowed by a marker but not on its line") for t in allowed - held]
    return findings


def test_docs_quote_only_figures_the_reports_hold() -> None:
    findings = unsourced(ROOT)
    assert not findings, "figures quoted outside the generated reports:\n" + "\n".join(map(str, findings))


# -- the checker itself, on hand-made pages --

REPORT = f"""{REPORT_HEADER}profile `quick`

| stage | wall time |
|---|---|
| benchmark | 12 min 32 s |
| long | 1 h 46 min 15 s |

ours: +31.4% [+5.3%, +57.5%] (n=3); ratio 2.35x; AUC 0.386; dp-clipping phantom_over_opacus 1.12
"""


def _tree(tmp_path: Path, doc: str, report: str = REPORT) -> Path:
    (tmp_path / "docs" / "results" / "archive").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "quick.md").write_text(report)
    (tmp_path / "README.md").write_text("# hand-made\n")
    (tmp_path / "docs" / "page.md").write_text(doc)
    return tmp_path


def test_checker_accepts_figures_the_report_holds(tmp_path: Path) -> None:
    doc = (
        "The quick run took 12 min 32 s; the long one 1 h 46 min (1 h 46).\n"
        "Ours is +31.4% [+5.3%, +57.5%] over the peer, 2.35x vanilla, AUC 0.386, Opacus / Phantom 1.12x.\n"
    )
    assert unsourced(_tree(tmp_path, doc)) == []


@pytest.mark.parametrize(
    ("line", "token"),
    [
        ("The quick run took 12 min 54 s.", "12 min 54 s"),
        ("The reference profile took 1 h 41 min.", "1 h 41 min"),
        ("It took 1 h 15 in all.", "1 h 15"),
        ("The tied-ghost ratio is 110.5 here.", "110.5"),
        ("Opacus / Phantom is 1.13x.", "1.13x"),
        ("MERGE is 2.3x vanilla.", "2.3x"),
        ("Ours is +31.5% over the peer.", "+31.5%"),
        ("Ours is \u22127.0% below the floor.", "-7.0%"),
        ("The AUC is 0.38 of 0.3861.", "0.3861"),
        ("The bench took 4 min 02 s.", "4 min 02 s"),
    ],
)
def test_checker_names_a_figure_no_report_holds(tmp_path: Path, line: str, token: str) -> None:
    findings = unsourced(_tree(tmp_path, f"# page\n\n{line}\n"))
    assert [(f.path, f.line, f.token) for f in findings] == [("docs/page.md", 3, token)]
    assert "no generated report" in str(findings[0])


def test_checker_ignores_the_archive_reports_code_and_short_numbers(tmp_path: Path) -> None:
    root = _tree(tmp_path, "Code: `--set lr=0.0005`, torch 2.13.0, eps 0.75, 3.5 s.\n\n    privbench bench 0.123\n")
    (root / "docs" / "results" / "archive" / "old.md").write_text("It took 12 min 54 s at commit `abc`.\n")
    (root / "docs" / "results" / "reference.md").write_text(REPORT.replace("quick", "reference") + "9.87x\n")
    (root / "docs" / "other.md").write_text("The reference report has 9.87x.\n")
    assert unsourced(root) == []


def test_checker_allows_a_marked_non_measurement_and_only_it(tmp_path: Path) -> None:
    allowed = "The paper reports 4.57% to 7.99% <!-- not a measurement: 4.57; 7.99 (DPFormer's Table 1) -->\n"
    assert unsourced(_tree(tmp_path, allowed)) == []
    partly = "Paper 4.57, ours 5.55 <!-- not a measurement: 4.57 (DPFormer's Table 1) -->\n"
    assert [f.token for f in unsourced(_tree(tmp_path / "b", partly))] == ["5.55"]
    stale = "The paper reports 4.57 <!-- not a measurement: 4.57; 7.99 (DPFormer's Table 1) -->\n"
    assert [(f.token, f.problem) for f in unsourced(_tree(tmp_path / "c", stale))] == [
        ("7.99", "is allowed by a marker but not on its line")
    ]
    no_reason = "The paper reports 4.57 <!-- not a measurement: 4.57 -->\n"
    assert {f.token for f in unsourced(_tree(tmp_path / "d", no_reason))} == {
        "<!-- not a measurement: 4.57 -->",
        "4.57",
    }


def test_checker_needs_a_report(tmp_path: Path) -> None:
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "notes.md").write_text("# notes\n")
    with pytest.raises(FileNotFoundError, match="privbench report"):
        unsourced(tmp_path)
