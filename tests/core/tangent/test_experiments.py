"""The tangent stage's experiment procedures (Tables 2-3, Fig. 1) on a tiny random Dinov2's cached features."""

from __future__ import annotations

import pytest
import torch

from core.errors import DataError
from core.tangent import experiments as X
from core.tangent.baselines import NonlinearSuffix, forget_by_retraining, sisa_logits, train_shards
from core.tangent.compose import compose
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
