"""MPC approximations of a LLaMA decoder (MPCFormer, THE-X on SmolLM2's architecture): the exact form equals the
Hugging Face model, each approximated form equals a hand-written float64 reference (per head, per position), the
forms keep causality, and distillation (plain or relative hidden loss) shrinks the student-teacher gap."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from core.errors import ConfigError
from core.mpc.approx import get_approximation, layerwise_loss, logits_kd_loss
from core.mpc.approx_llama import ApproxLlama, is_llama
from tests.core.mpc.conftest import tiny_gpt2

VOCAB = 50


def tiny_llama(dtype: torch.dtype = torch.float64, seed: int = 0) -> LlamaForCausalLM:
    """2 blocks of width 16, 4 query heads on 2 K/V heads, non-trivial norm gains; eager attention."""
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True, initializer_range=0.3,
        rms_norm_eps=1e-5,
    )  # fmt: skip
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(dtype).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
    return model


def _reference_logits(model: LlamaForCausalLM, ids: torch.Tensor, name: str) -> torch.Tensor:
    """The approximated forward written out: every head and query position in turn (float64)."""
    a = get_approximation(name)
    cfg, inner = model.config, model.model
    H, Hk = cfg.num_attention_heads, cfg.num_key_value_heads
    D = cfg.hidden_size // H
    eps = cfg.rms_norm_eps

    def norm(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if a.layernorm == "affine":
            return x * g
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g

    def act(x: torch.Tensor) -> torch.Tensor:
        if a.act == "quad":
            return 0.125 * x * x + 0.25 * x + 0.5
        if a.act == "relu":
            return x.clamp_min(0)
        return x / (1 + torch.exp(-x))  # silu

    def weights(scores: torch.Tensor) -> torch.Tensor:  # one query's scores over keys 0..i
        if a.softmax == "exact":
            e = torch.exp(scores - scores.max())
            return e / e.sum()
        if a.softmax == "2quad":
            f = (scores + a.c) ** 2
            return f / f.sum()
        f = (scores + a.c).clamp_min(0)  # 2ReLU, THE-X: the encrypted reciprocal's floor, 1e-3 a key
        return f / (f.sum() + 1e-3 * len(scores))

    n = ids.shape[1]
    inv = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]  # (n, D/2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rope(x: torch.Tensor) -> torch.Tensor:  # (n, D)
        return x * cos + torch.cat([-x[:, D // 2 :], x[:, : D // 2]], -1) * sin

    x = inner.embed_tokens.weight[ids[0]]  # (n, d)
    for layer in inner.layers:
        att, mlp = layer.self_attn, layer.mlp
        h = norm(layer.input_layernorm.weight, x)
        q, k, v = h @ att.q_proj.weight.T, h @ att.k_proj.weight.T, h @ att.v_proj.weight.T
        out = torch.zeros(n, H * D, dtype=x.dtype)
        for head in range(H):
            kv = head // (H // Hk)
            qh, kh = rope(q[:, head * D : (head + 1) * D]), rope(k[:, kv * D : (kv + 1) * D])
            vh = v[:, kv * D : (kv + 1) * D]
            for i in range(n):
                w = weights(torch.stack([qh[i] @ kh[j] / math.sqrt(D) for j in range(i + 1)]))
                out[i, head * D : (head + 1) * D] = (w[:, None] * vh[: i + 1]).sum(0)
        x = x + out @ att.o_proj.weight.T
        m = norm(layer.post_attention_layernorm.weight, x)
        x = x + (act(m @ mlp.gate_proj.weight.T) * (m @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return norm(inner.norm.weight, x) @ model.lm_head.weight.T  # (n, V)


def test_the_exact_form_equals_the_hf_model() -> None:
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    out = ApproxLlama(model, "exact")(ids)
    with torch.no_grad():
        ref = model(ids, output_attentions=True)
    # HF's RMSNorm computes in float32 whatever the model's dtype: agreement to float32's resolution
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=0)
    for a, b in zip(out.attentions, ref.attentions, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert len(out.hidden) == model.config.num_hidden_layers + 1


@pytest.mark.parametrize("name", ["exact", "mpcformer_2relu", "mpcformer_2quad", "thex"])
def test_each_form_equals_the_written_out_reference(name: str) -> None:
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = ApproxLlama(model, name)(ids).logits[0]
    # the model's rotary tables come from float32 frequencies, the reference's from float64
    torch.testing.assert_close(got, _reference_logits(model, ids, name), atol=1e-5, rtol=1e-6)


def test_the_forms_differ_from_the_model_and_the_reference_can_tell() -> None:
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        exact = ApproxLlama(model, "exact")(ids).logits[0]
        for name in ("mpcformer_2relu", "mpcformer_2quad", "thex"):
            got = ApproxLlama(model, name)(ids).logits[0]
            assert not torch.allclose(got, exact, atol=1e-3)
            assert not torch.allclose(got, _reference_logits(model, ids, "exact"), atol=1e-3)


@pytest.mark.parametrize("name", ["exact", "mpcformer_2relu", "mpcformer_2quad", "thex"])
def test_the_forms_keep_causality(name: str) -> None:
    student = ApproxLlama(tiny_llama(), name)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    later = ids.clone()
    later[:, 5:] = (later[:, 5:] + 17) % VOCAB
    with torch.no_grad():
        a, b = student(ids).logits, student(later).logits
    torch.testing.assert_close(a[:, :5], b[:, :5], atol=1e-12, rtol=0)
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_the_student_is_a_copy_and_its_model_holds_what_trains() -> None:
    model = tiny_llama()
    student = ApproxLlama(model, "thex")
    assert is_llama(student.hf) and student.hf is not model
    assert {id(p) for p in student.parameters()} == {id(p) for p in student.hf.parameters()}
    with pytest.raises(ConfigError, match="LLaMA-architecture"):
        ApproxLlama(tiny_gpt2(), "thex")


@pytest.mark.parametrize("relative", [False, True])
def test_distillation_shrinks_the_gap(relative: bool) -> None:
    from core.mpc.approx import distill

    teacher = tiny_llama(torch.float32)
    student = ApproxLlama(teacher, "mpcformer_2quad")
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (4, 10), generator=g) for _ in range(3)]

    def gap() -> float:
        with torch.no_grad():
            return sum(logits_kd_loss(student(b).logits, teacher(b).logits).item() for b in batches)

    before = gap()
    losses = distill(teacher, student, batches, steps=30, lr=3e-3, layerwise_fraction=0.3, relative=relative)
    assert len(losses) == 30 and gap() < before


def test_the_relative_hidden_loss_weighs_each_layer_by_the_teachers_scale() -> None:
    """A layer 1,000 times larger in the teacher counts alike once relative (a hand-made case)."""
    from core.mpc.approx import ApproxOutput

    def out(hidden: list[torch.Tensor]) -> ApproxOutput:
        return ApproxOutput(logits=torch.zeros(1, 2, 3), hidden=hidden, attentions=[])

    teacher = out([torch.ones(1, 2, 4), 1000 * torch.ones(1, 2, 4)])
    student = out([torch.ones(1, 2, 4) * 1.1, 1000 * torch.ones(1, 2, 4) * 1.1])  # 10% off on both layers
    plain = layerwise_loss(student, teacher)
    relative = layerwise_loss(student, teacher, relative=True)
    torch.testing.assert_close(plain, torch.tensor(0.01 + 1e4), rtol=1e-5, atol=0)
    torch.testing.assert_close(relative, torch.tensor(0.02), rtol=1e-5, atol=0)
