"""Clipper registry: every method against the brute-force loop, bounds, errors, hooks, dtypes."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.dp.clipping import (
    CLIPPERS,
    Clipper,
    ClippingMethod,
    DPClipper,
    LoopClipper,
    clip_coefficients,
    make_clipper,
    register_clipper,
    tied_parameter_names,
)
from core.errors import ConfigError, DataError, PrivacyError
from core.models import SeqRecConfig, build_seqrec, sequence_loss

M, L = 12, 6
IDS = torch.tensor([[0, 0, 3, 4, 5, 6], [1, 2, 3, 3, 5, 12], [0, 0, 0, 0, 0, 7], [9, 9, 9, 2, 1, 4]])
TARGETS = torch.tensor([[0, 0, 4, 5, 6, 7], [2, 3, 4, 5, 12, 1], [0, 0, 0, 0, 0, 3], [9, 9, 2, 1, 4, 4]])
DP_METHODS = ["phantom", "opacus_hooks", "opacus_ghost", "loop"]


def _model(arch="transformer", tied=True, dtype=torch.float64, seed=0, n_layers=2):
    torch.manual_seed(seed)
    cfg = SeqRecConfig(
        num_items=M, max_len=L, d_model=8, n_heads=2, n_layers=n_layers, dropout=0.0, tied=tied, arch=arch
    )
    return build_seqrec(cfg).to(dtype).train()


def _step(method, model, ids=IDS, targets=TARGETS, **kw):
    """One clipping step on a fresh clipper; returns (norms, {name: grad})."""
    settings_ = {"clip_norm": 0.3, "normalize": False} | kw
    clipper = make_clipper(method, model, **settings_)
    try:
        norms = clipper.backward(sequence_loss(clipper.model(ids), targets))
    finally:
        clipper.close()
    return norms, {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(a, b, rtol=1e-6):
    norms_a, grads_a = a
    norms_b, grads_b = b
    torch.testing.assert_close(norms_a, norms_b, rtol=rtol, atol=1e-9)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=rtol, atol=1e-9, msg=name)


def _brute_force_clipped_sum(model, clip_norm, normalize):
    """Independent reference: a separate forward/backward per sample, clipped with the same rule."""
    params = dict(model.named_parameters())
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(len(IDS)):
        loss = sequence_loss(model(IDS[i : i + 1]), TARGETS[i : i + 1]).sum()
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params.values(), grads)]
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        coef = clip_coefficients(norm, clip_norm=clip_norm, normalize=normalize)
        for n, g in zip(params, grads):
            total[n] += coef * g
    return total


@pytest.mark.parametrize("normalize", [False, True])
def test_loop_matches_independent_brute_force(normalize):
    model = _model()
    _, grads = _step("loop", model, normalize=normalize)
    expected = _brute_force_clipped_sum(model, 0.3, normalize)
    for name, g in grads.items():
        torch.testing.assert_close(g, expected[name], msg=name)


@pytest.mark.parametrize(
    "arch, tied, method",
    [
        ("transformer", True, "phantom"),
        ("transformer", True, "opacus_hooks"),
        ("transformer", True, "ghost_tied"),
        ("transformer", False, "phantom"),
        ("transformer", False, "opacus_hooks"),
        ("transformer", False, "opacus_ghost"),
        ("gru", True, "phantom"),
        ("gru", True, "opacus_hooks"),
        ("lstm", False, "phantom"),
        ("lstm", False, "opacus_hooks"),
    ],
)
@pytest.mark.parametrize("normalize", [False, True])
def test_methods_match_loop(arch, tied, method, normalize):
    base = _model(arch, tied, n_layers=1 if arch != "transformer" else 2)
    expected = _step("loop", copy.deepcopy(base), normalize=normalize)
    _assert_same(_step(method, copy.deepcopy(base), normalize=normalize), expected)


def test_nonprivate_is_plain_backward():
    model = _model()
    clipper = make_clipper(ClippingMethod.NONPRIVATE, model, clip_norm=1.0, normalize=False)
    assert clipper.backward(sequence_loss(clipper.model(IDS), TARGETS)) is None
    reference = _model()
    sequence_loss(reference(IDS), TARGETS).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_registry_exposes_one_interface():
    assert {m.value for m in ClippingMethod} == {
        "nonprivate",
        "phantom",
        "ghost_tied",
        "opacus_hooks",
        "opacus_ghost",
        "loop",
    }
    for method in ClippingMethod:
        model = _model(tied=False)
        clipper = make_clipper(method, model, clip_norm=1.0, normalize=False)
        assert isinstance(clipper, Clipper)
        clipper.close()


def test_the_builtin_methods_are_registered_in_order():
    assert list(CLIPPERS) == [m.value for m in ClippingMethod]


def test_a_registered_class_is_built_by_name_and_a_taken_or_bad_name_is_refused():
    saved = dict(CLIPPERS)
    try:

        @register_clipper("loop_again")
        class LoopAgain(LoopClipper):
            pass

        assert register_clipper("loop_again")(LoopAgain) is LoopAgain  # registering the same class again is a no-op
        model = _model(tied=False)
        assert isinstance(make_clipper("loop_again", model, clip_norm=1.0, normalize=False), LoopAgain)
        with pytest.raises(ConfigError, match=r"'phantom' is already registered \(core.dp.clipping.PhantomClipper\)"):
            register_clipper("phantom")(LoopAgain)
        for bad in ("Per-Layer", "", "2x", None):
            with pytest.raises(ConfigError, match="lower-case snake_case"):
                register_clipper(bad)(DPClipper)
        with pytest.raises(ConfigError, match=r"unknown clipping method 'loop_agian'; known: .*, loop, loop_again$"):
            make_clipper("loop_agian", model, clip_norm=1.0, normalize=False)
    finally:
        CLIPPERS.clear()
        CLIPPERS.update(saved)


def test_opacus_ghost_refuses_recurrent_layers_with_advice():
    with pytest.raises(ConfigError, match="recurrent layers .*phantom or opacus_hooks"):
        make_clipper("opacus_ghost", _model("lstm", tied=False, n_layers=1), clip_norm=1.0, normalize=False)


def test_opacus_ghost_refuses_tied_model_with_advice():
    assert tied_parameter_names(_model()) == ["item_emb.weight = output.weight"]
    with pytest.raises(ConfigError, match="tied=False.*footnote 5"):
        make_clipper("opacus_ghost", _model(), clip_norm=1.0, normalize=False)


@pytest.mark.parametrize(
    "kw, fragment",
    [
        ({"method": "fast"}, "known: nonprivate, phantom, ghost_tied, opacus_hooks, opacus_ghost, loop"),
        ({"clip_norm": 0.0}, "clip_norm"),
        ({"clip_norm": float("nan")}, "clip_norm"),
        ({"normalize": 1}, "normalize"),
        ({"gamma": -0.1}, "gamma"),
    ],
)
def test_make_clipper_validates(kw, fragment):
    args = {"method": "phantom", "clip_norm": 1.0, "normalize": False} | kw
    with pytest.raises(ConfigError, match=fragment):
        make_clipper(args.pop("method"), _model(), **args)


@pytest.mark.parametrize("method", ["nonprivate", *DP_METHODS])
def test_empty_batch_and_bad_losses_raise(method):
    model = _model(tied=False)
    clipper = make_clipper(method, model, clip_norm=1.0, normalize=False)
    loss = sequence_loss(clipper.model(IDS), TARGETS)
    with pytest.raises(PrivacyError, match="empty batch"):
        clipper.backward(loss[:0])
    with pytest.raises(PrivacyError, match=r"non-finite per-sample loss at batch indices \[1\]"):
        clipper.backward(loss * torch.tensor([1.0, float("nan"), 1.0, 1.0], dtype=loss.dtype))
    with pytest.raises(DataError, match=r"1-D \(B,\)"):
        clipper.backward(loss.unsqueeze(1))
    clipper.close()


@pytest.mark.parametrize("method", ["phantom", "opacus_hooks", "opacus_ghost"])
def test_close_removes_hooks(method):
    model = _model(tied=False)
    make_clipper(method, model, clip_norm=1.0, normalize=False).close()
    assert not any(m._forward_hooks or m._backward_hooks for m in model.modules())


@pytest.mark.parametrize("method", DP_METHODS)
def test_dtype_preserved_and_grads_accumulate(method):
    model = _model(tied=False)
    _, first = _step(method, model)
    norms, second = _step(method, model)  # p.grad not zeroed: the clipped sum is added
    assert norms.dtype == torch.float64
    for name in first:
        assert second[name].dtype == torch.float64
        torch.testing.assert_close(second[name], 2 * first[name])


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    clip_norm=st.floats(1e-3, 10.0),
    normalize=st.booleans(),
    sample=st.integers(0, len(IDS) - 1),
)
def test_each_clipped_contribution_is_bounded(seed, clip_norm, normalize, sample):
    model = _model(seed=seed, n_layers=1)
    norms, grads = _step(
        "phantom",
        model,
        IDS[sample : sample + 1],
        TARGETS[sample : sample + 1],
        clip_norm=clip_norm,
        normalize=normalize,
    )
    total = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
    assert total <= clip_norm * (1 + 1e-9)
    if not normalize and float(norms[0]) < clip_norm:  # flat clipping leaves small gradients alone
        assert math.isclose(total, float(norms[0]), rel_tol=1e-9)


@settings(max_examples=50, deadline=None)
@given(
    norms=st.lists(st.floats(0.0, 1e6), min_size=1, max_size=8),
    clip_norm=st.floats(1e-4, 1e3),
    gamma=st.floats(1e-4, 1.0),
    normalize=st.booleans(),
)
def test_clip_coefficients_bound_every_norm(norms, clip_norm, gamma, normalize):
    n = torch.tensor(norms, dtype=torch.float64)
    c = clip_coefficients(n, clip_norm=clip_norm, normalize=normalize, gamma=gamma)
    assert torch.all(c >= 0)
    assert torch.all(c * n <= clip_norm * (1 + 1e-12))
    if not normalize:
        assert torch.all(c <= 1.0)


@pytest.mark.parametrize("method", ["opacus_hooks", "opacus_ghost"])
def test_opacus_methods_need_training_mode(method):
    model = _model(tied=False)
    clipper = make_clipper(method, model, clip_norm=1.0, normalize=False)
    clipper.model.eval()
    with pytest.raises(PrivacyError, match="training mode"):
        clipper.backward(sequence_loss(clipper.model(IDS), TARGETS))
    assert all(p.grad is None for p in model.parameters())
    clipper.close()


def test_phantom_also_works_in_eval_mode():
    base = _model().eval()  # dropout off either way; phantom records whenever grad is enabled
    expected = _step("loop", copy.deepcopy(base))
    _assert_same(_step("phantom", copy.deepcopy(base)), expected)


# Windows: a row of K * max_len ids is one user (user-level DP over every training target); every clipper must
# give the norm of the user's summed gradient over all K windows (core.models.seqrec, "Windows").
WINDOW_IDS = torch.cat([IDS[[2, 0]].reshape(1, -1), IDS[[1, 3]].reshape(1, -1)])  # (2 users, 2 windows of L)
WINDOW_TARGETS = torch.cat([TARGETS[[2, 0]].reshape(1, -1), TARGETS[[1, 3]].reshape(1, -1)])


@pytest.mark.parametrize(
    "arch, tied, method",
    [
        ("transformer", True, "phantom"),
        ("transformer", True, "opacus_hooks"),
        ("transformer", True, "ghost_tied"),
        ("transformer", False, "opacus_ghost"),
        ("gru", True, "phantom"),
        ("lstm", True, "opacus_hooks"),
    ],
)
def test_windowed_rows_are_one_clipped_unit(arch, tied, method):
    """Reference: per user, the gradient of the summed loss of its windows fed as separate rows, clipped once."""
    base = _model(arch, tied, n_layers=1 if arch != "transformer" else 2)
    got = _step(method, copy.deepcopy(base), ids=WINDOW_IDS, targets=WINDOW_TARGETS)
    model = copy.deepcopy(base)
    params = dict(model.named_parameters())
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    norms = []
    for user in range(len(WINDOW_IDS)):
        rows, targets = WINDOW_IDS[user].view(2, L), WINDOW_TARGETS[user].view(2, L)
        loss = sequence_loss(model(rows), targets).sum()
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params.values(), grads)]
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        norms.append(norm)
        for n, g in zip(params, grads):
            total[n] += clip_coefficients(norm, clip_norm=0.3, normalize=False) * g
    _assert_same(got, (torch.stack(norms), total))
