"""Sequential recommenders (App. E.2): shapes, tying, causality, padding, Re-Attention hook, loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.errors import ConfigError, DataError
from core.models import (
    CausalSelfAttention,
    SeqRecConfig,
    TransformerSeqRec,
    attention_mask,
    build_seqrec,
    sequence_loss,
)

M, L = 12, 6


def _cfg(**kw) -> SeqRecConfig:
    base = {"num_items": M, "max_len": L, "d_model": 8, "n_heads": 2, "n_layers": 2, "dropout": 0.0}
    return SeqRecConfig(**(base | kw))


def _ids() -> torch.Tensor:
    return torch.tensor([[0, 0, 3, 4, 5, 6], [1, 2, 3, 3, 5, 12], [0, 0, 0, 0, 0, 7]])


@pytest.mark.parametrize(
    "kw, fragment",
    [
        ({"num_items": 0}, "num_items"),
        ({"max_len": -1}, "max_len"),
        ({"d_model": 8, "n_heads": 3}, "divisible"),
        ({"dropout": 1.0}, "dropout"),
        ({"arch": "bert"}, "known: transformer, gru, lstm"),
        ({"activation": "tanh"}, "known: relu, gelu"),
        ({"d_ff": 0}, "d_ff"),
        ({"tied": "yes"}, "tied"),
        ({"norm_first": 0}, "norm_first must be a bool"),
        ({"arch": "gru", "norm_first": False}, "norm_first=False .* needs arch='transformer'"),
    ],
)
def test_config_validation_names_bad_value(kw, fragment):
    with pytest.raises(ConfigError, match=fragment):
        _cfg(**kw)


def test_config_defaults_match_paper():
    cfg = SeqRecConfig(num_items=M, max_len=L)
    assert (cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.dropout, cfg.tied) == (64, 1, 2, 0.2, True)
    assert cfg.norm_first  # pre-LN by default; the DP methods pick post-LN (core.dp.methods)
    assert cfg.vocab_size == M + 1
    with pytest.raises(ConfigError, match="SeqRecConfig"):
        build_seqrec({"num_items": M})


@pytest.mark.parametrize("arch", ["transformer", "gru", "lstm"])
@pytest.mark.parametrize("tied", [True, False])
def test_shapes_and_tying(arch, tied):
    model = build_seqrec(_cfg(arch=arch, tied=tied))
    logits = model(_ids())
    assert logits.shape == (3, L, M + 1)
    assert (model.output.weight is model.item_emb.weight) == tied
    assert model.output.bias is None
    n_emb = sum(p.numel() for p in model.parameters() if p.shape == (M + 1, 8))
    assert n_emb == (M + 1) * 8 * (1 if tied else 2)


def test_tied_logits_are_hidden_times_embedding():
    model = build_seqrec(_cfg())
    ids = _ids()
    assert torch.allclose(model(ids), model.hidden(ids) @ model.item_emb.weight.T)


@pytest.mark.parametrize("norm_first", [True, False])
def test_attention_is_built_from_plain_linears(norm_first):
    model = build_seqrec(_cfg(norm_first=norm_first))
    kinds = {type(m) for m in model.modules() if list(m.parameters(recurse=False))}
    assert kinds == {torch.nn.Embedding, torch.nn.Linear, torch.nn.LayerNorm}


@pytest.mark.parametrize(("arch", "norm_first"), [("transformer", True), ("transformer", False), ("gru", True)])
def test_causal_future_items_do_not_change_past_scores(arch, norm_first):
    model = build_seqrec(_cfg(arch=arch, norm_first=norm_first)).eval()
    ids = _ids()
    changed = ids.clone()
    changed[:, -1] = 9
    assert torch.allclose(model(ids)[:, :-1], model(changed)[:, :-1])
    assert not torch.allclose(model(ids)[:, -1], model(changed)[:, -1])


@pytest.mark.parametrize("norm_first", [True, False])
def test_transformer_real_positions_ignore_left_padding(norm_first):
    model = build_seqrec(_cfg(norm_first=norm_first)).eval()
    padded = torch.tensor([[0, 0, 0, 3, 4, 5], [0, 0, 0, 0, 0, 7]])
    short = torch.tensor([[3, 4, 5], [0, 0, 7]])  # right-aligned positions: same as the padded batch
    out = model(padded)
    assert torch.allclose(out[:, -3:][short != 0], model(short)[short != 0], atol=1e-6)
    other = padded.clone()
    other[0, :3] = torch.tensor([0, 9, 1])  # different items *before* the real ones, still left of them
    assert not torch.allclose(model(other)[0, -3:], out[0, -3:])  # sanity: the context does matter


@pytest.mark.parametrize("norm_first", [True, False])
def test_padding_row_gets_no_input_side_gradient(norm_first):
    model = build_seqrec(_cfg(tied=False, norm_first=norm_first))
    sequence_loss(model(_ids()), _ids().roll(-1, 1)).sum().backward()
    assert torch.count_nonzero(model.item_emb.weight.grad[0]) == 0


def test_post_ln_block_is_vaswani_encoder_layer():
    """norm_first=False: LN(x + Attn(x)), LN(x + FFN(x)), no final LayerNorm; same sub-modules as pre-LN."""
    torch.manual_seed(0)
    post, pre = build_seqrec(_cfg(norm_first=False)).eval(), build_seqrec(_cfg()).eval()
    assert isinstance(post.final_norm, torch.nn.Identity) and isinstance(pre.final_norm, torch.nn.LayerNorm)
    names = {n for n, _ in pre.named_parameters() if not n.startswith("final_norm")}
    assert {n for n, _ in post.named_parameters()} == names
    ids = _ids()
    valid = ids != 0
    positions = torch.arange(L).repeat(3, 1)
    x = (post.item_emb(ids) + post.pos_emb(positions)) * valid.unsqueeze(-1)
    for block in post.blocks:
        x = block.ln_attn(x + block.attn(x, valid))
        x = block.ln_ff(x + block.ff(x))
    torch.testing.assert_close(post.hidden(ids), x)
    torch.testing.assert_close(post(ids), x @ post.item_emb.weight.T)


def test_attention_mask_is_causal_and_lets_padding_see_itself():
    mask = attention_mask(torch.tensor([[False, True, True]]))[0, 0]
    expected = torch.tensor([[True, False, False], [False, True, False], [False, True, True]])
    assert torch.equal(mask, expected)


def test_score_correction_hook_shape_and_effect():
    model = build_seqrec(_cfg()).eval()
    ids = _ids()
    seen = []

    def identity(logits):
        seen.append(logits.shape)
        return logits

    base = model(ids)
    assert torch.allclose(model(ids, score_correction=identity), base)
    assert seen == [(3, 2, L, L)] * 2  # one call per block, (B, H, L, L)

    def penalise_first_key(logits):
        return logits - 5.0 * (torch.arange(L) == 2).to(logits)

    assert not torch.allclose(model(ids, score_correction=penalise_first_key), base)
    model.set_score_correction([penalise_first_key, None])  # per block, persistent
    assert model.attention_layers[0].score_correction is penalise_first_key
    persistent = model(ids)
    assert not torch.allclose(persistent, base)
    model.set_score_correction(None)
    assert torch.allclose(model(ids), base)
    with pytest.raises(ConfigError, match="one score correction per block"):
        model.set_score_correction([identity])


def test_score_correction_receives_query_when_it_asks():
    attn = CausalSelfAttention(d_model=8, n_heads=2)
    got = {}

    def with_query(logits, query=None):
        got["query"] = query.shape
        return logits

    attn(torch.randn(3, L, 8), torch.ones(3, L, dtype=torch.bool), score_correction=with_query)
    assert got["query"] == (3, 2, L, 4)
    with pytest.raises(DataError, match=r"\(B, H, L, L\)"):
        attn(torch.randn(3, L, 8), torch.ones(3, L, dtype=torch.bool), score_correction=lambda x: x[0])


def test_rnn_rejects_score_correction():
    with pytest.raises(ConfigError, match="arch='gru'"):
        build_seqrec(_cfg(arch="gru"))(_ids(), score_correction=lambda x: x)


@pytest.mark.parametrize(
    "ids, fragment",
    [
        (torch.zeros(3, L + 1, dtype=torch.long), "max_len"),
        (torch.full((2, L), M + 1), r"\[0, num_items=12\]"),
        (torch.zeros(2, L), "int64"),
        (torch.zeros(L, dtype=torch.long), "int64"),
    ],
)
def test_bad_inputs_raise_data_error(ids, fragment):
    with pytest.raises(DataError, match=fragment):
        build_seqrec(_cfg())(ids)


def test_float64_model_keeps_dtype():
    model = build_seqrec(_cfg(arch="lstm")).double()
    assert model(_ids()).dtype == torch.float64
    assert isinstance(build_seqrec(_cfg()), TransformerSeqRec)


# ----------------------------------------------------------------------------- sequence_loss


def test_sequence_loss_sums_cross_entropy_over_valid_positions():
    torch.manual_seed(0)
    logits = torch.randn(3, L, M + 1)
    targets = _ids().roll(-1, 1)
    targets[2] = 0  # an all-padding sequence
    loss = sequence_loss(logits, targets)
    manual = torch.stack(
        [
            sum(
                (F.cross_entropy(logits[b, t], targets[b, t]) for t in range(L) if targets[b, t] != 0),
                torch.tensor(0.0),
            )
            for b in range(3)
        ]
    )
    assert loss.shape == (3,)
    assert torch.allclose(loss, manual)
    assert loss[2] == 0
    n_valid = (targets != 0).sum(1).clamp(min=1)
    assert torch.allclose(sequence_loss(logits, targets, position_reduction="mean"), manual / n_valid)
    assert torch.allclose(sequence_loss(logits, targets, "sum"), manual.sum())
    assert torch.allclose(sequence_loss(logits, targets, "mean"), manual.mean())


def test_sequence_loss_validates_arguments():
    logits, targets = torch.randn(2, L, M + 1), torch.ones(2, L, dtype=torch.long)
    with pytest.raises(ConfigError, match="known: none, sum, mean"):
        sequence_loss(logits, targets, "avg")
    with pytest.raises(ConfigError, match="position_reduction"):
        sequence_loss(logits, targets, position_reduction="max")
    with pytest.raises(DataError, match=r"targets \(B, L\)"):
        sequence_loss(logits, targets[:, :-1])


@pytest.mark.parametrize("arch", ["transformer", "gru", "lstm"])
def test_windows_are_encoded_like_separate_rows(arch):
    """A row of K * max_len ids scores like its K windows fed as K rows (slow reference: one row each)."""
    torch.manual_seed(0)
    cfg = SeqRecConfig(num_items=20, max_len=5, d_model=8, n_heads=2, n_layers=2, dropout=0.0, arch=arch)
    model = build_seqrec(cfg).double().eval()
    ids = torch.randint(0, 21, (3, 15))
    ids[0, :7] = 0  # left padding across a window boundary
    ids[1, :5] = 0  # one all-padding window
    rows = ids.view(9, 5)
    with torch.no_grad():
        windowed = model(ids)  # (3, 15, 21)
        separate = torch.cat([model(rows[i : i + 1]) for i in range(9)]).view(3, 15, 21)
    torch.testing.assert_close(windowed, separate)


def test_window_length_must_be_a_multiple_of_max_len():
    model = build_seqrec(SeqRecConfig(num_items=20, max_len=5, d_model=8, n_heads=2))
    with pytest.raises(DataError, match="multiple of max_len"):
        model(torch.ones(2, 7, dtype=torch.long))


@pytest.mark.parametrize("arch", ["gru", "lstm"])
def test_linear_rnn_matches_torch(arch):
    """LinearGRU / LinearLSTM (nn.Linear cells, for per-sample gradients) equal torch.nn.GRU / LSTM."""
    from core.models.seqrec import LinearGRU, LinearLSTM

    torch.manual_seed(0)
    ours = (LinearGRU if arch == "gru" else LinearLSTM)(6, num_layers=2, dropout=0.0).double()
    ref = (torch.nn.GRU if arch == "gru" else torch.nn.LSTM)(6, 6, num_layers=2, batch_first=True).double()
    with torch.no_grad():
        for layer in range(2):
            getattr(ref, f"weight_ih_l{layer}").copy_(ours.ih[layer].weight)
            getattr(ref, f"bias_ih_l{layer}").copy_(ours.ih[layer].bias)
            getattr(ref, f"weight_hh_l{layer}").copy_(ours.hh[layer].weight)
            getattr(ref, f"bias_hh_l{layer}").copy_(ours.hh[layer].bias)
    x = torch.randn(4, 7, 6, dtype=torch.float64)
    torch.testing.assert_close(ours(x.unsqueeze(1)).squeeze(1), ref(x)[0])
