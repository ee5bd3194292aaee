"""Parsers of core.data.ratings: hand-written files, every error path, fast path vs reference."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.data import (
    Interactions,
    parse_amazon_csv,
    parse_amazon_jsonl,
    parse_ml1m,
    parse_ml100k,
    parse_recbole,
)
from core.data.ratings import _ML1M, _parse_columns, _parse_reference
from core.errors import DataError

# ------------------------------------------------------------------------------- happy paths


def test_ml1m_reads_fields_types_and_order(write_file) -> None:
    path = write_file("ratings.dat", "1::1193::5::978300760\n1::661::3::978302109\n2::1193::4::978298413\n")
    inter = parse_ml1m(path)
    assert inter.users.tolist() == [1, 1, 2] and inter.users.dtype == np.int64
    assert inter.items.tolist() == [1193, 661, 1193] and inter.items.dtype == np.int64
    assert inter.ratings.tolist() == [5.0, 3.0, 4.0] and inter.ratings.dtype == np.float32
    assert inter.timestamps.tolist() == [978300760, 978302109, 978298413]
    assert inter.timestamps.dtype == np.int64
    assert inter.source == str(path)
    assert (len(inter), inter.n_users, inter.n_items) == (3, 2, 2)


def test_ml100k_reads_tab_separated(write_file) -> None:
    inter = parse_ml100k(write_file("u.data", "196\t242\t3\t881250949\n186\t302\t3\t891717742\n"))
    assert inter.users.tolist() == [196, 186] and inter.items.tolist() == [242, 302]
    assert inter.timestamps.tolist() == [881250949, 891717742]


def test_recbole_finds_columns_by_name_and_accepts_float_timestamps(write_file) -> None:
    text = (
        "timestamp:float\textra:token_seq\titem_id:token\trating:float\tuser_id:token\n"
        "881250949.0\ta b\t0242\t3\t196\n"
        "891717742\t\t302\t4.5\t186\n"
    )
    inter = parse_recbole(write_file("x.inter", text))
    assert inter.users.tolist() == ["196", "186"] and inter.users.dtype.kind == "U"
    assert inter.items.tolist() == ["0242", "302"]  # tokens keep leading zeros
    assert inter.ratings.tolist() == [3.0, 4.5]
    assert inter.timestamps.tolist() == [881250949, 891717742]


def test_recbole_without_rating_column_is_implicit_feedback(write_file) -> None:
    inter = parse_recbole(write_file("x.inter", "user_id:token\titem_id:token\ttimestamp:float\nu\ti\t7\n"))
    assert inter.ratings.tolist() == [1.0]


def test_amazon_csv_keeps_string_ids(write_file) -> None:
    text = "A2SUAM1J3GNN3B,0000013714,5.0,1355616000\nA1,B00ZZ,1,1355616001\n"
    inter = parse_amazon_csv(write_file("ratings_Video_Games.csv", text))
    assert inter.users.tolist() == ["A2SUAM1J3GNN3B", "A1"]
    assert inter.items.tolist() == ["0000013714", "B00ZZ"]
    assert inter.ratings.tolist() == [5.0, 1.0]
    assert inter.timestamps.tolist() == [1355616000, 1355616001]


def test_amazon_jsonl_ignores_other_keys(write_file) -> None:
    reviews = [
        {"reviewerID": "A1", "asin": "0700099867", "reviewerName": "x", "helpful": [8, 12],
         "reviewText": "Installing the game was a struggle", "overall": 1.0, "summary": "Pay to unlock",
         "unixReviewTime": 1341792000, "reviewTime": "07 9, 2012"},
        {"reviewerID": "A2", "asin": "B1", "overall": 4, "unixReviewTime": 1341792001},
    ]  # fmt: skip
    inter = parse_amazon_jsonl(write_file("Video_Games_5.json", "\n".join(map(json.dumps, reviews))))
    assert inter.users.tolist() == ["A1", "A2"] and inter.items.tolist() == ["0700099867", "B1"]
    assert inter.ratings.tolist() == [1.0, 4.0]
    assert inter.timestamps.tolist() == [1341792000, 1341792001]


def test_blank_lines_crlf_and_gzip_are_fine(write_file, tmp_path: Path) -> None:
    expected = parse_ml1m(write_file("a.dat", "1::2::3::4\n5::6::1::8\n"))
    assert parse_ml1m(write_file("b.dat", "1::2::3::4\r\n\n5::6::1::8\r\n\n  \n")).same_data(expected)
    gz = tmp_path / "c.dat.gz"
    gz.write_bytes(gzip.compress(b"1::2::3::4\n5::6::1::8\n"))
    assert parse_ml1m(gz).same_data(expected)


def test_ml1m_is_latin1(write_file) -> None:
    path = write_file("ratings.dat", "1::2::3::4\n1::2::3::caf\xe9\n", encoding="latin-1")
    with pytest.raises(DataError, match="café"):
        parse_ml1m(path)


# ------------------------------------------------------------------------------------ errors

BAD_DELIMITED = [
    ("1::2::3\n", "expected 4 fields"),
    ("1::2::3::4::5\n", "expected 4 fields"),
    ("1::2::five::4\n", "Rating 'five' is not a number"),
    ("1::2::nan::4\n", "not a finite"),
    ("1::2::3::yesterday\n", "Timestamp 'yesterday' is not a number"),
    ("1::2::3::4.5\n", "not a whole number of seconds"),
    ("x::2::3::4\n", "UserID 'x' is not an integer"),
    ("1::99999999999999999999::3::4\n", "does not fit in int64"),
]


@pytest.mark.parametrize(("bad_line", "message"), BAD_DELIMITED)
def test_malformed_line_names_file_line_and_content(write_file, bad_line: str, message: str) -> None:
    path = write_file("ratings.dat", "1::2::3::4\n\n" + bad_line + "7::8::9::10\n")
    with pytest.raises(DataError, match=message) as info:
        parse_ml1m(path)
    assert f"{path}:3:" in str(info.value)
    assert repr(bad_line.rstrip("\n")) in str(info.value)


def test_blank_string_id_is_rejected(write_file) -> None:
    with pytest.raises(DataError, match=r"a\.csv:2: user is empty"):
        parse_amazon_csv(write_file("a.csv", "A,B,5.0,1\n ,B,5.0,2\n"))


def test_long_bad_line_is_truncated(write_file) -> None:
    with pytest.raises(DataError) as info:
        parse_ml100k(write_file("u.data", "1\t2\t3\t4\n" + "9" * 5000 + "\n"))
    assert len(str(info.value)) < 400 and "..." in str(info.value)


BAD_JSONL = [
    ('{"reviewerID": "A", "asin": "B", "overall": 5.0', "invalid JSON"),
    ('["A", "B", 5.0, 1]', "expected a JSON object"),
    ('{"reviewerID": "A", "overall": 5.0, "unixReviewTime": 1}', r"missing key\(s\) \['asin'\]"),
    ('{"reviewerID": "A", "asin": "B", "overall": "5", "unixReviewTime": 1}', "overall must be a number"),
    ('{"reviewerID": "A", "asin": "B", "overall": true, "unixReviewTime": 1}', "overall must be a number"),
    ('{"reviewerID": 7, "asin": "B", "overall": 5.0, "unixReviewTime": 1}', "reviewerID must be a string"),
    ('{"reviewerID": "A", "asin": "", "overall": 5.0, "unixReviewTime": 1}', "asin is empty"),
    ('{"reviewerID": "A", "asin": "B", "overall": 5.0, "unixReviewTime": 1.5}', "whole number"),
]


@pytest.mark.parametrize(("bad_line", "message"), BAD_JSONL)
def test_malformed_json_line(write_file, bad_line: str, message: str) -> None:
    good = '{"reviewerID": "A", "asin": "B", "overall": 5.0, "unixReviewTime": 1}'
    path = write_file("r.json", f"{good}\n{bad_line}\n")
    with pytest.raises(DataError, match=message) as info:
        parse_amazon_jsonl(path)
    assert f"{path}:2:" in str(info.value)


def test_recbole_header_must_name_required_columns(write_file) -> None:
    with pytest.raises(DataError, match=r"x\.inter:1: .*missing \['timestamp'\]"):
        parse_recbole(write_file("x.inter", "user_id:token\titem_id:token\n1\t2\n"))


def test_recbole_line_numbers_count_the_header(write_file) -> None:
    path = write_file("x.inter", "user_id:token\titem_id:token\ttimestamp:float\n1\t2\t3\n1\t2\n")
    with pytest.raises(DataError, match=r"x\.inter:3: expected 3 fields"):
        parse_recbole(path)


@pytest.mark.parametrize(
    ("parser", "content"),
    [
        (parse_ml1m, ""),
        (parse_ml100k, "\n\n  \n"),
        (parse_amazon_csv, ""),
        (parse_amazon_jsonl, "\n"),
        (parse_recbole, ""),
        (parse_recbole, "user_id:token\titem_id:token\ttimestamp:float\n\n"),
    ],
)
def test_empty_file_is_an_error(write_file, parser, content: str) -> None:
    with pytest.raises(DataError, match="file is empty"):
        parser(write_file("empty.txt", content))


@pytest.mark.parametrize("parser", [parse_ml1m, parse_ml100k, parse_recbole, parse_amazon_csv, parse_amazon_jsonl])
def test_missing_path_and_directory(tmp_path: Path, parser) -> None:
    missing = tmp_path / "nope" / "ratings.dat"
    with pytest.raises(DataError, match=f"{missing}: no such file"):
        parser(missing)
    with pytest.raises(DataError, match="is not a file"):
        parser(tmp_path)


def test_corrupt_gzip_is_a_data_error(write_file) -> None:
    with pytest.raises(DataError, match="cannot be read"):
        parse_ml1m(write_file("r.dat.gz", b"\x1f\x8b\x08\x00garbage"))


# ------------------------------------------------------------------ fast path vs reference

_cell = st.sampled_from(["1", "42", "-3", " 7", "007", "1e3", "4.0", "2.5", "x", "", "nan", "inf", "1_0"])
_int_cell = st.sampled_from(["1", "42", "-3", " 7", "007", "1_0", "9007199254740993"])
_valid_line = st.tuples(
    _int_cell,
    _int_cell,
    st.sampled_from(["1", "4.0", "2.5", "1e3"]),
    st.sampled_from(["1", "007", "1e3", "4.0"]),
).map("::".join)


def _assert_fast_agrees(lines: list[str]) -> bool:
    """The column-wise parse matches the line-by-line reference, or defers to it; True if it matched."""
    fast = _parse_columns(lines, _ML1M)
    try:
        reference = _parse_reference(Path("f"), lines, _ML1M, first_lineno=1)
    except DataError:
        assert fast is None
        return False
    if fast is None:
        return False
    for a, b in zip(fast, reference, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    return True


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(st.lists(_cell, min_size=3, max_size=5).map("::".join), min_size=1, max_size=6))
def test_fast_parse_agrees_with_reference_on_any_line(lines: list[str]) -> None:
    _assert_fast_agrees(lines)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(_valid_line, min_size=1, max_size=6))
def test_fast_parse_handles_valid_lines_itself(lines: list[str]) -> None:
    assert _assert_fast_agrees(lines)  # well-formed files never need the reference parser


@pytest.mark.slow
def test_a_million_lines_parse_in_seconds(tmp_path: Path) -> None:
    from time import perf_counter

    from core.data import ml1m_shaped, write_synthetic

    path = write_synthetic(tmp_path / "ratings.dat", ml1m_shaped(), fmt="ml-1m", seed=0)
    start = perf_counter()
    inter = parse_ml1m(path)
    assert len(inter) > 900_000 and perf_counter() - start < 5.0


# ------------------------------------------------------------------------------ the container


def test_interactions_validates_and_is_read_only() -> None:
    inter = Interactions(np.array([1, 2]), np.array(["a", "b"]), [5, 4], [10, 11])
    assert inter.ratings.dtype == np.float32 and inter.timestamps.dtype == np.int64
    with pytest.raises(ValueError, match="read-only"):
        inter.users[0] = 3
    with pytest.raises(DataError, match="one length"):
        Interactions(np.array([1, 2]), np.array([1]), [5, 4], [10, 11])
    with pytest.raises(DataError, match="int or str ids"):
        Interactions(np.array([1.5]), np.array([1]), [5], [10])
    assert inter.take(np.array([1])).items.tolist() == ["b"]
    assert inter.same_data(Interactions(np.array([1, 2]), np.array(["a", "b"]), [5, 4], [10, 11], "elsewhere"))
    assert not inter.same_data(Interactions(np.array(["1", "2"]), np.array(["a", "b"]), [5, 4], [10, 11]))
