"""The secure-inference training recipes (``core.mpc.recipes``): each returns a typed result, draws from its seed
alone, and trains the same weights as the steps it stands for written out by hand (what the task did inline)."""

from __future__ import annotations

import pytest
import torch

from core.errors import ConfigError
from core.models.gpt2 import tiny_gpt2
from core.mpc import merge, recipes
from core.mpc.approx import ApproxGPT2, distill
from core.mpc.finetune import DialogueData, finetune_lm, lm_batches, stream_blocks
from core.mpc.gpt2 import GPT2Weights, weights_from_hf
from core.mpc.merge_spec import MergeSpec
from core.mpc.recipes import Curve, GPT2Shape, TrainedModel

V, T, SEED = 40, 10, 3
SHAPE = GPT2Shape(vocab=V, n_layer=1, n_embd=16, n_head=2, n_positions=16, eos=0)


def _data() -> DialogueData:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (12, T), generator=g)
    mask = torch.ones(12, T, dtype=torch.bool)
    mask[::3, 7:] = False  # some right padding
    test_ids, test_mask = ids[:4].clone(), mask[:4].clone()
    return DialogueData("tiny", 12, 4, ids, mask, test_ids, test_mask, [], lm_batches(ids, mask, 4, seed=0))


def _teacher() -> dict[str, torch.Tensor]:
    return recipes.train_finetuned(SHAPE, _data(), steps=2, lr=1e-3, seed=0).model.state_dict()


def _hand_model(state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """The stage's GPT-2 as the task built it: the global RNG seeded, a random draw, the teacher loaded over it."""
    torch.manual_seed(SEED)
    model = tiny_gpt2(V, n_layer=1, n_embd=16, n_head=2, n_positions=16, eos_token_id=0)
    if state is not None:
        model.load_state_dict(state)
    return model.eval()


def _equal(a: object, b: object) -> bool:
    """Every tensor of two payloads (dataclasses of tensors and tuples of them) equal."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "__dataclass_fields__"):
        return all(_equal(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


def _recipes(teacher: dict[str, torch.Tensor]) -> dict[str, TrainedModel]:
    data = _data()
    blocks = torch.randint(0, V, (30 * 8,), generator=torch.Generator().manual_seed(1))
    train, val = stream_blocks(blocks, 8, val_every=5)
    common = {"steps": 2, "lr": 1e-3, "seed": SEED}
    return {
        "pretrained": recipes.train_pretrained(SHAPE, train, val, None, batch_size=4, warmup=1, eval_every=1, **common),
        "finetuned": recipes.train_finetuned(SHAPE, data, teacher, **common),
        "distilled": recipes.train_distilled(SHAPE, data, teacher, approx="mpcformer_2quad", **common),
        "er": recipes.train_er(SHAPE, data, teacher, er=merge.ERConfig(), **common),
        "mm": recipes.train_mm(SHAPE, data, teacher, n_max=6, **common),
    }


def test_every_recipe_returns_a_typed_result_and_leaves_the_global_rng_alone() -> None:
    teacher = _teacher()
    torch.manual_seed(1234)
    before = torch.random.get_rng_state().clone()
    done = _recipes(teacher)
    assert torch.equal(torch.random.get_rng_state(), before)
    for name, result in done.items():
        assert isinstance(result, TrainedModel) and not result.model.training, name
        assert result.train_s >= 0 and len(result.curves["train_loss"].values) == 2, name
        assert all(isinstance(c, Curve) for c in result.curves.values()), name
    assert {n: type(r.payload) for n, r in done.items()} == {
        "pretrained": GPT2Weights,
        "finetuned": GPT2Weights,
        "distilled": GPT2Weights,
        "er": GPT2Weights,
        "mm": MergeSpec,
    }
    # ER and MM curves are one type: a loss per step
    assert type(done["er"].curves["train_loss"]) is type(done["mm"].curves["train_loss"]) is Curve
    assert done["er"].curves["align_loss"].steps is None and done["mm"].curves["train_loss"].steps is None
    assert done["pretrained"].curves["val_loss_curve"].steps == (1, 2)
    assert set(done["pretrained"].metrics) == {
        "val_loss",
        "val_perplexity",
        "val_loss_full_vocab",
        "n_parameters",
        "pretrain_vocab",
        "train_tokens",
        "val_tokens",
        "epochs",
    }
    assert set(done["finetuned"].metrics) == {"test_loss", "n_parameters"}
    assert set(done["er"].metrics) == {"test_loss"} and not done["mm"].metrics and not done["distilled"].metrics
    assert done["mm"].payload.layers[0].C.shape == (2, 6, 6)  # (heads, n_max, n_max)


def test_the_same_seed_trains_the_same_weights_and_another_seed_others() -> None:
    data = _data()
    a, b = (recipes.train_finetuned(SHAPE, data, steps=2, lr=1e-3, seed=SEED) for _ in range(2))
    c = recipes.train_finetuned(SHAPE, data, steps=2, lr=1e-3, seed=SEED + 1)
    assert _equal(a.payload, b.payload) and a.curves == b.curves
    assert not torch.equal(a.payload.wte, c.payload.wte)


def test_finetuned_equals_the_steps_written_out() -> None:
    data = _data()
    for start in (None, _teacher()):
        with torch.random.fork_rng(devices=[]):
            model = _hand_model(start)
            losses = finetune_lm(model, data.batches, 2, 1e-3, seed=SEED)
        done = recipes.train_finetuned(SHAPE, data, start, steps=2, lr=1e-3, seed=SEED)
        assert _equal(done.payload, weights_from_hf(model)) and done.curves["train_loss"].values == tuple(losses)


def test_distilled_er_and_mm_equal_the_steps_written_out() -> None:
    data, teacher = _data(), _teacher()
    short = [(i[:, :6], m[:, :6]) for i, m in data.batches]
    with torch.random.fork_rng(devices=[]):
        start = _hand_model(teacher)
        student = ApproxGPT2(start, "thex")
        distill(start, student, data.batches, 2, 1e-3)
        hf = tiny_gpt2(V, n_layer=1, n_embd=16, n_head=2, n_positions=16, eos_token_id=0)
        hf.transformer.wte, hf.transformer.wpe, hf.transformer.h, hf.transformer.ln_f = (
            student.wte,
            student.wpe,
            student.h,
            student.ln_f,
        )
        hf.lm_head = student.lm_head
        distilled = weights_from_hf(hf.eval())
    with torch.random.fork_rng(devices=[]):
        er_model = _hand_model(teacher)
        history = merge.train_er(er_model, data.batches, 2, 1e-3, cfg=merge.ERConfig(), seed=SEED)
        er = weights_from_hf(er_model.eval())
    with torch.random.fork_rng(devices=[]):
        source = _hand_model(teacher)
        mm_model = merge.build_merge_model(source, short, 6)
        merge.train_mm(mm_model, source, short, 2, 1e-3)
        mm = merge.export_spec(mm_model.eval())

    common = {"steps": 2, "lr": 1e-3, "seed": SEED}
    assert _equal(recipes.train_distilled(SHAPE, data, teacher, approx="thex", **common).payload, distilled)
    er_done = recipes.train_er(SHAPE, data, teacher, er=merge.ERConfig(), **common)
    assert _equal(er_done.payload, er)
    assert er_done.curves["align_loss"].values == tuple(h["align"] for h in history)
    assert _equal(recipes.train_mm(SHAPE, data, teacher, n_max=6, **common).payload, mm)


def test_curves_and_shapes_refuse_bad_values() -> None:
    assert Curve.at_steps([(5, 1.0), (10, 0.5)]) == Curve((1.0, 0.5), (5, 10))
    with pytest.raises(ConfigError, match="one step per value"):
        Curve((1.0, 2.0), (1,))
    with pytest.raises(ConfigError, match="n_embd=15 must be a multiple of n_head=2"):
        GPT2Shape(vocab=V, n_layer=1, n_embd=15, n_head=2, n_positions=16, eos=0)
    with pytest.raises(ConfigError, match="n_layer=0"):
        GPT2Shape(vocab=V, n_layer=0, n_embd=16, n_head=2, n_positions=16, eos=0)
    with pytest.raises(ConfigError, match="eos=40"):
        GPT2Shape(vocab=V, n_layer=1, n_embd=16, n_head=2, n_positions=16, eos=40)
