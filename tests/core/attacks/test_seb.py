"""SEB (paper Sec. 4): the byte mapping, the three variants against slow references, gradient row patterns
(what a FILM attacker reads), and the Hugging Face drop-in on tiny GPT-2 / Llama models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core.attacks.seb import (
    VARIANTS,
    SEBEmbedding,
    SEBLMHead,
    build_byte_mapping,
    install_seb,
    mapping_is_unique,
)
from core.errors import ConfigError, DataError
from core.models.gpt2 import tiny_gpt2

V, D = 50, 16


@pytest.fixture(scope="module")
def mapping() -> torch.Tensor:
    return build_byte_mapping(V, n_bytes=4, byte_vocab=8, seed=1)


def make(mapping: torch.Tensor, variant: str, **kw) -> SEBEmbedding:
    torch.manual_seed(0)
    return SEBEmbedding(mapping, D, variant=variant, byte_dim=6, hidden=12, byte_vocab=8, **kw)


# --- mapping (Sec. 4.1) ---------------------------------------------------------------------------------------


def test_gpt2_sized_mapping_is_unique_and_in_range() -> None:
    m = build_byte_mapping(50257, n_bytes=8, byte_vocab=256, seed=0)
    assert m.shape == (50257, 8) and m.dtype == torch.int64
    assert int(m.min()) >= 0 and int(m.max()) < 256
    assert mapping_is_unique(m)


@pytest.mark.parametrize("vocab", [60, 64])
def test_tight_mapping_is_unique(vocab: int) -> None:
    m = build_byte_mapping(vocab, n_bytes=3, byte_vocab=4, seed=3)  # 4**3 = 64 slots
    assert m.shape == (vocab, 3) and int(m.max()) < 4 and mapping_is_unique(m)


def test_mapping_is_deterministic_per_seed() -> None:
    a, b, c = (build_byte_mapping(1000, seed=s) for s in (7, 7, 8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_mapping_is_unique_helper_detects_duplicates() -> None:
    assert not mapping_is_unique(torch.tensor([[1, 2], [3, 4], [1, 2]]))


def test_impossible_mapping_names_the_numbers() -> None:
    with pytest.raises(ConfigError, match=r"4\*\*3 = 64 < vocab_size=65.*raise n_bytes or byte_vocab"):
        build_byte_mapping(65, n_bytes=3, byte_vocab=4)


@pytest.mark.parametrize("kw", [{"vocab_size": 0}, {"n_bytes": 0}, {"byte_vocab": 1}, {"byte_vocab": 0}])
def test_bad_mapping_arguments_raise(kw: dict) -> None:
    args = {"vocab_size": 10, "n_bytes": 4, "byte_vocab": 16} | kw
    with pytest.raises(ConfigError, match=next(iter(kw))):
        build_byte_mapping(args.pop("vocab_size"), **args)


# --- SEBEmbedding (Sec. 4.2) ----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_shapes_and_table_agree_with_forward(mapping: torch.Tensor, variant: str) -> None:
    seb = make(mapping, variant)
    ids = torch.randint(0, V, (3, 7))
    out = seb(ids)
    assert out.shape == (3, 7, D)
    assert seb(ids[0]).shape == (7, D)
    torch.testing.assert_close(seb.table()[ids], out, rtol=1e-6, atol=1e-6)
    assert seb.table().shape == (V, D)
    assert (seb.vocab_size, seb.n_bytes, seb.byte_vocab, seb.variant, seb.d_model) == (V, 4, 8, variant, D)


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradient_reaches_every_parameter(mapping: torch.Tensor, variant: str) -> None:
    seb = make(mapping, variant)
    seb(torch.arange(V)).pow(2).sum().backward()
    for name, p in seb.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def slow_reference(seb: SEBEmbedding, ids: torch.Tensor) -> torch.Tensor:
    """The Sec. 4.2 formulas spelled out: explicit byte lookups and explicit one-hots + nn.Linear."""
    n, vb = seb.n_bytes, seb.byte_vocab
    rows = []
    for v in ids.tolist():
        b = seb.mapping[v]
        if seb.variant == "co":
            onehot = torch.cat([F.one_hot(b[j], vb).to(seb.w1.dtype) for j in range(n)])  # (n*V_b,)
            lin = nn.Linear(n * vb, seb.hidden).to(seb.w1.dtype)
            lin.weight.data, lin.bias.data = seb.w1.data.T.clone(), seb.b1.data.clone()
            h = lin(onehot)
        elif seb.variant == "ar":
            h = seb.fc1(sum(seb.byte_emb.weight[b[j]] for j in range(n)))
        else:
            h = seb.fc1(torch.cat([seb.byte_emb.weight[b[j]] for j in range(n)]))
        rows.append(seb.fc2(torch.relu(h)))
    return torch.stack(rows)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fast_path_matches_slow_reference(mapping: torch.Tensor, variant: str) -> None:
    seb = make(mapping, variant).double()
    ids = torch.randint(0, V, (20,))
    with torch.no_grad():
        torch.testing.assert_close(seb(ids), slow_reference(seb, ids), rtol=1e-6, atol=1e-6)


def test_co_float32_matches_one_hot_linear(mapping: torch.Tensor) -> None:
    seb = make(mapping, "co")
    ids = torch.arange(V)
    with torch.no_grad():
        torch.testing.assert_close(seb(ids), slow_reference(seb, ids), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_byte_weight_gradient_rows_are_exactly_the_used_bytes(mapping: torch.Tensor, variant: str) -> None:
    seb = make(mapping, variant)
    ids = torch.tensor([[3, 17, 3], [41, 0, 29]])
    seb(ids).sum().backward()
    nonzero = set(torch.nonzero(seb.byte_weight.grad.abs().sum(1)).flatten().tolist())
    used = mapping[ids.flatten()]  # (m, n)
    if variant == "co":
        expected = set((used + torch.arange(4) * 8).flatten().tolist())  # rows j*V_b + M[v, j]
        assert seb.byte_weight.shape == (4 * 8, 12)
    else:
        expected = set(used.flatten().tolist())
        assert seb.byte_weight.shape == (8, 6)
    assert nonzero == expected


def test_out_of_range_ids_name_the_vocabulary_mismatch(mapping: torch.Tensor) -> None:
    seb = make(mapping, "co")
    with pytest.raises(DataError, match=rf"max id {V}.*vocab_size={V}.*vocabulary mismatch"):
        seb(torch.tensor([1, V]))
    with pytest.raises(DataError, match="vocabulary mismatch"):
        seb(torch.tensor([-1, 2]))


def test_bad_variant_and_mapping_raise(mapping: torch.Tensor) -> None:
    with pytest.raises(ConfigError, match="'xx'.*ar"):
        SEBEmbedding(mapping, D, variant="xx")
    with pytest.raises(ConfigError, match="2-D"):
        SEBEmbedding(mapping[0], D)
    with pytest.raises(ConfigError, match="byte_vocab=4"):
        SEBEmbedding(mapping, D, byte_vocab=4)


def test_mapping_is_a_persistent_buffer_and_parameter_count(mapping: torch.Tensor) -> None:
    seb = make(mapping, "co")
    assert torch.equal(seb.state_dict()["mapping"], mapping)
    assert seb.embedding_parameter_count() == 4 * 8 * 12 + 12 + 12 * D + D


def test_lm_head_scores_the_whole_vocabulary(mapping: torch.Tensor) -> None:
    seb = make(mapping, "cr")
    h = torch.randn(2, 5, D)
    logits = SEBLMHead(seb)(h)
    assert logits.shape == (2, 5, V)
    torch.testing.assert_close(logits, h @ seb.table().T)


# --- install_seb on Hugging Face causal LMs -------------------------------------------------------------------


def tiny_model(kind: str, vocab: int = 97) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        return tiny_gpt2(vocab, n_layer=1, n_embd=32, n_head=4, n_positions=32, eos_token_id=0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("output", ["seb", "tied", "subword"])
def test_install_seb_trains_and_generates(kind: str, output: str) -> None:
    model = install_seb(tiny_model(kind), build_byte_mapping(97), hidden=48, output=output)
    model.tie_weights()  # must not re-tie a subword head
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(emb, SEBEmbedding) and emb.d_model == 32
    assert model.config.tie_word_embeddings is False
    assert model.config.seb == {
        "variant": "co",
        "n_bytes": 8,
        "byte_vocab": 256,
        "byte_dim": 64,
        "hidden": 48,
        "output": output,
    }
    if output == "subword":
        assert isinstance(head, nn.Linear) and head.weight.shape == (97, 32)
    else:
        assert isinstance(head, SEBLMHead) and (head.seb is emb) == (output == "tied")
    ids = torch.randint(0, 97, (2, 9))
    out = model(input_ids=ids, labels=ids)
    assert abs(out.loss.item() - torch.log(torch.tensor(97.0)).item()) < 0.5  # init keeps logits small
    out.loss.backward()
    assert emb.byte_weight.grad is not None and emb.byte_weight.grad.abs().sum() > 0
    model.eval()
    gen = model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert gen.shape == (1, 7)


def test_separate_output_keeps_input_gradient_on_input_bytes() -> None:
    mapping = build_byte_mapping(97)
    model = install_seb(tiny_model("gpt2"), mapping, hidden=48, output="seb")
    ids = torch.tensor([[5, 9, 11, 5]])
    model(input_ids=ids, labels=ids).loss.backward()
    grad = model.get_input_embeddings().byte_weight.grad
    nonzero = set(torch.nonzero(grad.abs().sum(1)).flatten().tolist())
    assert nonzero == set((mapping[ids.flatten()] + torch.arange(8) * 256).flatten().tolist())


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_vocabulary_mismatch_raises(kind: str) -> None:
    with pytest.raises(ConfigError, match=r"96 rows.*vocab_size=97.*vocabulary mismatch"):
        install_seb(tiny_model(kind), build_byte_mapping(96))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_state_dict_round_trip(kind: str) -> None:
    mapping = build_byte_mapping(97, seed=4)
    a = install_seb(tiny_model(kind), mapping, variant="cr", hidden=40).eval()
    state = a.state_dict()
    mapping_keys = [k for k in state if k.endswith("mapping")]
    assert mapping_keys and all(torch.equal(state[k], mapping) for k in mapping_keys)
    fresh = tiny_model(kind)
    torch.manual_seed(123)
    b = install_seb(fresh, build_byte_mapping(97, seed=5), variant="cr", hidden=40).eval()
    ids = torch.randint(0, 97, (2, 6))
    with torch.no_grad():
        assert not torch.allclose(a(input_ids=ids).logits, b(input_ids=ids).logits)
    b.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(a(input_ids=ids).logits, b(input_ids=ids).logits, rtol=0, atol=0)
    assert torch.equal(b.get_input_embeddings().mapping, mapping)


@pytest.mark.parametrize(
    ("n_bytes", "byte_vocab", "millions"),
    [(4, 64, 0.79), (4, 128, 1.05), (4, 256, 1.57), (8, 64, 1.05), (8, 128, 1.57), (8, 256, 2.62),
     (16, 64, 1.57), (16, 128, 2.62), (16, 256, 4.72)],
)  # fmt: skip
def test_co_parameter_count_matches_paper_table_4(n_bytes: int, byte_vocab: int, millions: float) -> None:
    """Table 4: SEB_co embedding parameters with a 1024-unit FFN into the 512-d IWSLT14 Transformer."""
    mapping = build_byte_mapping(16, n_bytes=n_bytes, byte_vocab=byte_vocab)
    seb = SEBEmbedding(mapping, 512, variant="co", hidden=1024, byte_vocab=byte_vocab)
    assert round(seb.embedding_parameter_count() / 1e6, 2) == millions


# ------------------------------------------------------------------ SEB at a subword table's parameter count


@pytest.mark.parametrize("variant", ["ar", "cr", "co"])
@pytest.mark.parametrize(
    ("d_model", "hidden", "n_bytes", "byte_vocab", "byte_dim"), [(16, 8, 4, 32, 8), (8, 3, 2, 7, 5)]
)
def test_the_parameter_count_is_the_modules(variant, d_model, hidden, n_bytes, byte_vocab, byte_dim) -> None:
    from core.attacks.seb import seb_parameter_count

    mapping = build_byte_mapping(40, n_bytes=n_bytes, byte_vocab=byte_vocab, seed=1)
    module = SEBEmbedding(mapping, d_model, variant=variant, byte_dim=byte_dim, hidden=hidden, byte_vocab=byte_vocab)
    shape = {"d_model": d_model, "n_bytes": n_bytes, "byte_vocab": byte_vocab, "byte_dim": byte_dim}
    assert seb_parameter_count(variant, hidden=hidden, **shape) == module.embedding_parameter_count()


@pytest.mark.parametrize("variant", ["ar", "cr", "co"])
def test_matched_hidden_is_the_widest_within_the_budget(variant) -> None:
    """Against asking every width in turn (the slow, obvious search) over budgets around each step of the count."""
    from core.attacks.seb import matched_hidden, seb_parameter_count

    shape = {"d_model": 6, "n_bytes": 3, "byte_vocab": 5, "byte_dim": 4}

    def count(h: int) -> int:
        return seb_parameter_count(variant, hidden=h, **shape)

    for budget in sorted({count(h) + delta for h in range(1, 40) for delta in (-1, 0, 1)}):
        if budget < count(1):
            with pytest.raises(ConfigError, match=f"more than the budget {budget}"):
                matched_hidden(budget, variant, **shape)
            continue
        widest = max(h for h in range(1, 60) if count(h) <= budget)
        assert matched_hidden(budget, variant, **shape) == widest
