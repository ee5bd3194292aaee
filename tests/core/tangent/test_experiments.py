"""The tangent stage's experiment procedures (Tables 2-3, Fig. 1) on a tiny random Dinov2's cached features."""

from __future__ import annotations

import copy

import pytest
import torch

from core.errors import DataError
from core.tangent import experiments as X
from core.tangent.baselines import (
    NonlinearSuffix,
    forget_by_retraining,
    model_soup,
    sisa_logits,
    train_nonlinear_shards,
    train_shards,
)
from core.tangent.compose import compose, remove_component
from core.tangent.shards import ShardIndex
from core.tangent.train import TangentTrainConfig, evaluate
from tests.core.tangent.test_train import C, Setup

CFG = TangentTrainConfig(epochs=1, batch_size=8, lr=1e-2, kappa=5.0)


@pytest.fixture(scope="module")
def s() -> Setup:
    return Setup(torch.float64, n=32)


@pytest.fixture(scope="module")
def shards(s: Setup) -> tuple[ShardIndex, list[dict[str, torch.Tensor]]]:
    index = X.shard_index(32, 4, seed=0)
    return index, train_shards(s.make, s.cached, s.y, index, CFG)


def test_basics_are_seeded_and_checked() -> None:
    a, b = X.make_head(8, 3, seed=1), X.make_head(8, 3, seed=1)
    assert torch.equal(a.weight, b.weight) and not a.bias.any() and float(a.weight.detach().std()) < 0.05
    assert X.accuracy(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]), torch.tensor([0, 1, 1])) == 2 / 3
    with pytest.raises(DataError, match="cannot split 3 training images into 4 shards"):
        X.shard_index(3, 4, seed=0)
    assert X.forget_sample(100, 0) == X.forget_sample(100, 0) < 100
    forget = X.forget_set(100, 0.25, 0)
    assert forget == X.forget_set(100, 0.25, 0) and len(forget) == 25 and len(X.forget_set(100, 1e-6, 0)) == 1


def test_compose_and_check_holds_eq_13(s: Setup, shards: tuple) -> None:
    _, deltas = shards
    model = s.make()
    out = X.compose_and_check(model, deltas, s.cached, s.y, batch_size=8, check=16)
    assert out["composition_max_abs_err"] <= 1e-10 and out["composition_max_abs_err_float32"] <= 1e-6
    assert out["test_accuracy"] == evaluate(model, s.cached, s.y)  # the model is left composed
    model.set_delta(compose(deltas))
    assert out["test_accuracy"] == evaluate(model, s.cached, s.y)
    assert out["compose_s"] >= 0 and out["inference_s"] > 0


def test_soup_and_sisa_accuracies(s: Setup) -> None:
    suffixes = [NonlinearSuffix(s.backbone, X.make_head(32, C, seed=j).double(), 1) for j in range(3)]
    sisa = X.sisa_accuracy(suffixes, s.cached, s.y, batch_size=8)
    assert sisa["test_accuracy"] == X.accuracy(sisa_logits(suffixes, s.cached), s.y) and sisa["inference_s"] > 0
    soup = X.soup_accuracy(suffixes, s.cached, s.y)
    assert 0.0 <= soup["test_accuracy"] <= 1.0


def test_forget_by_subtraction_curve_is_exact_unlearning(s: Setup, shards: tuple) -> None:
    _, deltas = shards
    parts = [torch.randn(32, C, generator=torch.Generator().manual_seed(j), dtype=torch.float64) for j in range(4)]
    curve, summary = X.forget_by_subtraction_curve(s.make(), deltas, parts, s.cached, s.y, trials=2, seed=0)
    assert curve["removed"] == [0, 1, 2, 3] and len(curve["taft_accuracy"]) == len(curve["sisa_accuracy"]) == 4
    full = s.make()
    full.set_delta(compose(deltas))
    assert curve["taft_accuracy"][0] == evaluate(full, s.cached, s.y)  # nothing removed: the composition
    assert curve["sisa_accuracy"][0] == X.accuracy(sum(parts) / 4, s.y)
    assert summary["unlearning_max_abs_err"] <= 1e-12  # float64: subtraction == composing the rest
    assert summary["forget_output_max_abs_err"] <= 1e-12  # and its logits == the ensemble of the rest
    assert summary["taft_drop_half_removed"] == curve["taft_accuracy"][0] - curve["taft_accuracy"][2]
    again, _ = X.forget_by_subtraction_curve(s.make(), deltas, parts, s.cached, s.y, trials=2, seed=0)
    assert again == curve  # the removal orders come from the seed


def test_forget_one_by_retraining_retrains_the_samples_shard(s: Setup, shards: tuple) -> None:
    index, deltas = shards
    sample = int(index.shards[1][0])
    out = X.forget_one_by_retraining(s.make, deltas, index, sample, s.cached, s.y, s.cached, s.y, CFG)
    assert out["shard_size"] == index.shards[1].numel()
    new, k, _ = forget_by_retraining(s.make, s.cached, s.y, index, sample, CFG)
    model = s.make()
    model.set_delta(compose([new if j == k else d for j, d in enumerate(deltas)]))
    assert out["shard_retrain_accuracy"] == evaluate(model, s.cached, s.y)
    assert out["full_over_shard_retrain_time"] == pytest.approx(out["full_retrain_s"] / out["shard_retrain_s"])
    assert 0.0 <= out["full_retrain_accuracy"] <= 1.0


def test_forget_fraction_retrains_only_touched_shards(s: Setup, shards: tuple) -> None:
    index, deltas = shards
    forget = {int(index.shards[0][0]), int(index.shards[0][1]), int(index.shards[2][0])}
    out = X.forget_fraction(s.make, deltas, index, forget, s.cached, s.y, s.cached, s.y, CFG)
    assert out["shards_retrained"] == 2 and out["n_forgotten"] == 3
    assert out["accuracy_drop"] == pytest.approx(out["accuracy_before"] - out["accuracy_after"])
    model = s.make()
    model.set_delta(compose(deltas))
    assert out["accuracy_before"] == evaluate(model, s.cached, s.y)
    with pytest.raises(DataError, match="emptied every shard"):
        X.forget_fraction(s.make, deltas, index, set(range(32)), s.cached, s.y, s.cached, s.y, CFG)


def test_forget_output_error_is_float64_rounding_for_float32_shards() -> None:
    """The runs train float32 shards: the check repeats the subtractions in float64, so it stays exact."""
    s32 = Setup(torch.float32, n=32)
    deltas = train_shards(s32.make, s32.cached, s32.y, X.shard_index(32, 4, seed=0), CFG)
    parts = [torch.zeros(32, C) for _ in range(4)]
    _, summary = X.forget_by_subtraction_curve(s32.make(), deltas, parts, s32.cached, s32.y, trials=2, seed=0)
    assert summary["forget_output_max_abs_err"] <= 1e-12


def test_forget_output_error_fails_on_a_wrong_subtraction(
    s: Setup, shards: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Subtracting the wrong shard's delta (the next one) leaves a model that is not the ensemble of the rest."""
    _, deltas = shards

    def wrong_shard(composed: dict, component: dict, n: int) -> dict:
        k = next(i for i, d in enumerate(deltas) if all(torch.equal(t, d[m].to(t.dtype)) for m, t in component.items()))
        other = {m: t.to(component[m].dtype) for m, t in deltas[(k + 1) % len(deltas)].items()}
        return remove_component(composed, other, n)

    parts = [torch.zeros(32, C, dtype=torch.float64) for _ in range(4)]
    monkeypatch.setattr(X, "remove_component", wrong_shard)
    _, summary = X.forget_by_subtraction_curve(s.make(), deltas, parts, s.cached, s.y, trials=1, seed=0)
    assert summary["forget_output_max_abs_err"] > 1e-6  # far above the claim's 1e-9


def test_forget_output_error_fails_for_non_linear_shards(s: Setup, shards: tuple) -> None:
    """The same subtraction on the weights of non-linear (NLFT) shard models averaged into a soup: the weight
    arithmetic is as exact as for tangent models (the old rule's check), the function is not the ensemble."""
    index, deltas = shards
    head = X.make_head(32, C, seed=0).double()
    models = train_nonlinear_shards(s.backbone, head, s.cached, s.y, index, CFG)
    states = [{n: p.detach() for n, p in m.named_parameters()} for m in models]
    rest = [0, 2, 3]
    forgotten = remove_component(compose(states), states[1], 4)
    direct = compose([states[i] for i in rest])
    assert max(float((forgotten[n] - direct[n]).abs().max()) for n in direct) <= 1e-12  # weights: exact
    subtracted = copy.deepcopy(models[0])
    subtracted.load_state_dict(forgotten)
    soup = X.logits_of(model_soup([models[i] for i in rest]), s.cached)
    assert torch.allclose(X.logits_of(subtracted, s.cached), soup, rtol=0, atol=1e-12)  # it is the soup of the rest
    nonlinear = X.forget_output_error(subtracted, [X.logits_of(models[i], s.cached) for i in rest], s.cached)
    assert nonlinear > 1e-6  # far above the claim's 1e-9: a Model Soup is not an ensemble

    tangent = s.make()  # the same subtraction of tangent shard models: their ensemble exactly
    tangent.set_delta(remove_component(compose(deltas), deltas[1], 4))
    parts = []
    for i in rest:
        m = s.make()
        m.set_delta(deltas[i])
        parts.append(X.logits_of(m, s.cached))
    assert X.forget_output_error(tangent, parts, s.cached) <= 1e-12
