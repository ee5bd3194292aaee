"""Translation with subword / SEB embeddings (SEB paper Sec. 5.2.1) at toy scale: SacreBLEU settings, shapes,
shared embeddings, greedy decoding, and a few hundred training steps on a synthetic reversal "language pair"."""

from __future__ import annotations

import pytest
import sacrebleu
import torch

from core.attacks.seb import SEBEmbedding, SEBLMHead, build_byte_mapping
from core.attacks.translation import (
    EMBEDDINGS,
    Seq2SeqLM,
    bleu,
    embedding_parameter_count,
    train_translation,
    translate,
)
from core.errors import ConfigError, DataError

V, PAD, BOS, EOS = 24, 0, 1, 2
SPECIAL = {"bos_id": BOS, "eos_id": EOS, "pad_id": PAD}


def model(embedding: str = "subword", **kw) -> Seq2SeqLM:
    mapping = None if embedding == "subword" else build_byte_mapping(V, n_bytes=4, byte_vocab=16)
    args = {
        "d_model": 64,
        "nhead": 4,
        "num_layers": 2,
        "ff": 128,
        "max_len": 16,
        "hidden": 128,
        "byte_dim": 16,
    }
    return Seq2SeqLM(V, embedding=embedding, mapping=mapping, pad_id=PAD, dropout=0.0, **(args | kw))


def reversal_pairs(n: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Source: 3-8 random content tokens; target: the same tokens reversed."""
    g = torch.Generator().manual_seed(seed)
    src = [torch.randint(3, V, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    return src, [s[::-1] for s in src]


def words(seqs: list[list[int]]) -> list[str]:
    return [" ".join(f"w{t}" for t in s) for s in seqs]


def test_bleu_uses_sacrebleu_13a_case_sensitive() -> None:
    assert bleu(["The cat sat on the mat."], ["The cat sat on the mat."]) == pytest.approx(100.0)
    hyp, ref = ["the cat is on the mat"], ["the cat sat on the mat"]
    # 13a: 6 tokens each, n-gram matches 5/6, 3/5, 1/4, 0/3; sacrebleu's default "exp" smoothing turns the zero
    # 4-gram precision into 1 / (2 * 3); equal lengths, so no brevity penalty
    expected = 100 * (5 / 6 * 3 / 5 * 1 / 4 * 1 / (2 * 3)) ** 0.25
    assert bleu(hyp, ref) == pytest.approx(expected, rel=1e-6)
    assert bleu(hyp, ref) == pytest.approx(sacrebleu.corpus_bleu(hyp, [ref]).score)
    assert bleu(["The Cat sat on the mat"], ["the cat sat on the mat"]) < 60  # case-sensitive


def test_bleu_rejects_bad_input() -> None:
    with pytest.raises(DataError, match="1 hypotheses, 2 refs"):
        bleu(["a"], ["a", "b"])
    with pytest.raises(DataError, match="no hypotheses"):
        bleu([], [])


@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_shapes_and_shared_embeddings(embedding: str) -> None:
    m = model(embedding)
    src, tgt = torch.randint(3, V, (2, 7)), torch.randint(3, V, (2, 5))
    assert m(src, tgt).shape == (2, 5, V)
    if embedding == "subword":
        assert embedding_parameter_count(m) == V * 64
        assert not any(isinstance(x, SEBEmbedding) for x in m.modules())
    else:
        assert isinstance(m.tok, SEBEmbedding) and isinstance(m.head, SEBLMHead) and m.head.seb is m.tok
        assert m.tok.variant == embedding.removeprefix("seb_")
        assert embedding_parameter_count(m) == m.tok.embedding_parameter_count()


def test_padding_does_not_change_the_logits() -> None:
    m = model().eval()
    src, tgt = torch.tensor([[5, 6, 7]]), torch.tensor([[BOS, 7, 6]])
    padded = torch.tensor([[5, 6, 7, PAD, PAD]])
    with torch.no_grad():
        torch.testing.assert_close(m(src, tgt), m(padded, tgt), rtol=1e-5, atol=1e-5)


def test_bad_configuration_raises() -> None:
    with pytest.raises(ConfigError, match="'bpe'"):
        Seq2SeqLM(V, embedding="bpe")
    with pytest.raises(ConfigError, match="needs mapping"):
        Seq2SeqLM(V, embedding="seb_co")
    with pytest.raises(ConfigError, match="pad_id"):
        Seq2SeqLM(V, pad_id=V)
    src, tgt = reversal_pairs(4, 0)
    with pytest.raises(DataError, match="4 sources and 3 targets"):
        train_translation(model(), src, tgt[:3], steps=1, batch_size=2, lr=1e-3, **SPECIAL)
    with pytest.raises(DataError, match="no source"):
        translate(model(), [], **SPECIAL)
    with pytest.raises(DataError, match="max_len=16"):
        model()(torch.ones(1, 17, dtype=torch.long), torch.ones(1, 2, dtype=torch.long))


@pytest.mark.parametrize("embedding", ["subword", "seb_co"])
def test_training_raises_bleu_on_reversal(embedding: str) -> None:
    train_src, train_tgt = reversal_pairs(2000, seed=0)
    test_src, test_tgt = reversal_pairs(100, seed=1)
    m = model(embedding)
    before = bleu(words(translate(m, test_src, max_len=12, **SPECIAL)), words(test_tgt))
    stats = train_translation(m, train_src, train_tgt, steps=300, batch_size=32, lr=3e-3, warmup=30, **SPECIAL)
    hyps = translate(m, test_src, max_len=12, **SPECIAL)
    after = bleu(words(hyps), words(test_tgt))
    assert stats["steps"] == 300
    assert before < 5 and after > 20, (before, after, stats)
    assert all(EOS not in h and BOS not in h for h in hyps)
