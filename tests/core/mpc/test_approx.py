"""MPC approximations of GPT-2 (MPCFormer, THE-X): formulas, causality, distillation."""

from __future__ import annotations

import pytest
import torch

from core.errors import ConfigError
from core.mpc.approx import (
    APPROXIMATIONS,
    ApproxGPT2,
    _norm,
    approx_softmax,
    distill,
    get_approximation,
    logits_kd_loss,
)
from core.mpc.merge_spec import activation
from tests.core.mpc.conftest import tiny_gpt2


def test_registry_names_and_unknown_name():
    assert {"mpcformer_2relu", "mpcformer_2quad", "thex"} <= set(APPROXIMATIONS)
    with pytest.raises(ConfigError, match="mpcformer_2relu.*mpcformer_2quad.*thex"):
        get_approximation("nope")
    with pytest.raises(ConfigError, match="nope"):
        ApproxGPT2(tiny_gpt2(), "nope")


def test_exact_forward_equals_hf_model():
    model = tiny_gpt2()
    ids = torch.randint(0, 100, (2, 9))
    out = ApproxGPT2(model, "exact")(ids)
    ref = model(ids, output_hidden_states=True, output_attentions=True)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-10, rtol=0)
    for a, b in zip(out.hidden, ref.hidden_states, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


@pytest.mark.parametrize(("kind", "c"), [("2relu", 0.0), ("2quad", 5.0), ("thex", 3.0)])
def test_softmax_approximations_match_formula_and_mask(kind, c):
    s = torch.randn(2, 3, 5, 5, dtype=torch.float64) * 2
    p = approx_softmax(s, kind, c)
    f = torch.relu(s + c) if kind != "2quad" else (s + c) ** 2
    for i in range(5):  # query i sees keys 0..i; 2ReLU and THE-X add the encrypted reciprocal's floor, 1e-3 a key
        num = f[..., i, : i + 1]
        floor = 0.0 if kind == "2quad" else 1e-3 * (i + 1)
        torch.testing.assert_close(p[..., i, : i + 1], num / (num.sum(-1, keepdim=True) + floor))
        assert torch.all(p[..., i, i + 1 :] == 0)


@pytest.mark.parametrize("name", ["mpcformer_2relu", "mpcformer_2quad", "thex"])
def test_the_distilled_student_is_the_model_run_under_mpc(name):
    """The student that distillation trains (ApproxGPT2) computes the logits of the plaintext twin of its encrypted
    run (core.mpc.gpt2's reference with the method's MPC variant): what is distilled is what runs and is scored."""
    from core.mpc import gpt2 as G
    from core.mpc.methods import method_spec

    model = tiny_gpt2()
    student = ApproxGPT2(model, name)  # a copy of the model's weights, run with the approximations
    w = G.weights_from_hf(model)  # the payload the encrypted run takes (float32)
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        twin = G.plaintext_logits(w, method_spec(name).variant, ids).double()
        torch.testing.assert_close(twin, student(ids).logits, atol=1e-5, rtol=1e-4)


def test_activation_formulas():
    x = torch.linspace(-3, 3, 13, dtype=torch.float64)
    torch.testing.assert_close(activation("quad", x), 0.125 * x**2 + 0.25 * x + 0.5)
    torch.testing.assert_close(activation("relu", x), x.clamp_min(0))


def test_thex_layernorm_is_affine():
    student = ApproxGPT2(tiny_gpt2(), "thex")
    ln = student.ln_f
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    torch.testing.assert_close(_norm(ln, x, "affine"), x * ln.weight + ln.bias)
    exact = ApproxGPT2(tiny_gpt2(), "exact")
    torch.testing.assert_close(_norm(ln, x, "exact"), torch.nn.functional.layer_norm(x, (16,), ln.weight, ln.bias))
    assert not torch.allclose(student(torch.arange(4)[None]).logits, exact(torch.arange(4)[None]).logits)


@pytest.mark.parametrize("name", ["mpcformer_2relu", "mpcformer_2quad", "thex", "exact"])
def test_approximations_keep_causality(name):
    student = ApproxGPT2(tiny_gpt2(), name)
    ids = torch.randint(0, 100, (2, 8))
    ids2 = ids.clone()
    ids2[:, 5:] = (ids2[:, 5:] + 17) % 100
    a, b = student(ids).logits, student(ids2).logits
    torch.testing.assert_close(a[:, :5], b[:, :5], atol=1e-12, rtol=0)
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_distillation_reduces_student_teacher_gap():
    teacher = tiny_gpt2(dtype=torch.float32)
    student = ApproxGPT2(teacher, "mpcformer_2quad")
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 100, (4, 10), generator=g) for _ in range(3)]

    def gap() -> float:
        with torch.no_grad():
            return sum(logits_kd_loss(student(b).logits, teacher(b).logits).item() for b in batches)

    before = gap()
    losses = distill(teacher, student, batches, steps=30, lr=3e-3, layerwise_fraction=0.3)
    assert len(losses) == 30
    assert gap() < before


def test_distill_rejects_bad_arguments():
    teacher = tiny_gpt2(dtype=torch.float32)
    with pytest.raises(ConfigError, match="steps"):
        distill(teacher, ApproxGPT2(teacher, "thex"), [torch.zeros(1, 3, dtype=torch.long)], steps=0, lr=1e-3)
