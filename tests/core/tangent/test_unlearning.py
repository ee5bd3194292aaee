"""One forget request served by TAFT, SISA and full retraining (core.tangent.unlearning), on a tiny random
Dinov2's cached features in float64: subtraction gives exactly the composition of the remaining shards, the
forgotten examples have no influence on any method's result, and the costs (training steps, per-example
gradients, forward passes per test batch) are counted right."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from torch import Tensor

from core.errors import ConfigError, DataError
from core.tangent import experiments as X
from core.tangent import unlearning as U
from core.tangent.baselines import NonlinearSuffix, train_nonlinear, train_nonlinear_shards, train_shards
from core.tangent.compose import ensemble_logits
from core.tangent.shards import ShardIndex
from core.tangent.train import TangentTrainConfig, train_tangent
from tests.core.tangent.test_train import C, Setup

CFG = TangentTrainConfig(epochs=2, batch_size=4, lr=1e-2, kappa=5.0, seed=3)
NLFT = TangentTrainConfig(epochs=1, batch_size=4, lr=1e-3, loss="ce", seed=3)
N, S = 32, 4


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models: one thread is fastest, and far faster than two on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def s() -> Setup:
    return Setup(torch.float64, n=N)


@pytest.fixture(scope="module")
def index() -> ShardIndex:
    return X.shard_index(N, S, seed=0)


@pytest.fixture(scope="module")
def deltas(s: Setup, index: ShardIndex) -> list[dict[str, Tensor]]:
    return train_shards(s.make, s.cached, s.y, index, CFG)


@pytest.fixture(scope="module")
def request_(index: ShardIndex) -> U.ForgetRequest:
    return U.forget_request(index, 3, 2, seed=0)


def _by_hand(deltas: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The slow, obvious composition: the element-wise mean, summed one delta at a time."""
    out = {}
    for name in deltas[0]:
        total = torch.zeros_like(deltas[0][name])
        for d in deltas:
            total = total + d[name]
        out[name] = total / len(deltas)
    return out


def _max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def _scrambled(s: Setup, request: U.ForgetRequest) -> tuple[Tensor, Tensor]:
    """The training set with the forgotten examples' features replaced by noise and their labels flipped."""
    h, y = s.cached.clone(), s.y.clone()
    idx = torch.tensor(request.examples)
    h[idx] = torch.randn(h[idx].shape, generator=torch.Generator().manual_seed(9), dtype=h.dtype) * 50
    y[idx] = (y[idx] + 1) % C
    return h, y


def test_the_request_falls_in_exactly_the_asked_shards(index: ShardIndex, request_: U.ForgetRequest) -> None:
    assert len(request_.examples) == 3 and len(set(request_.examples)) == 3 and len(request_.shards) == 2
    assert {index.shard_of(i) for i in request_.examples} == set(request_.shards)
    assert U.forget_request(index, 3, 2, seed=0) == request_  # seeded
    assert U.forget_request(index, 5, 4, seed=1).shards == (0, 1, 2, 3)
    rest = U.remaining(index, request_)
    for k, keep in rest.items():
        assert set(keep.tolist()) == set(index.shards[k].tolist()) - set(request_.examples)
    with pytest.raises(ConfigError, match="cannot fall in 3 of 4 shards"):
        U.forget_request(index, 2, 3, seed=0)
    with pytest.raises(ConfigError, match="cannot fall in 5 of 4 shards"):
        U.forget_request(index, 9, 5, seed=0)
    with pytest.raises(DataError, match="fewer than the 9"):
        U.forget_request(index, 9, 1, seed=0)
    with pytest.raises(DataError, match="not the ones holding"):
        U.remaining(index, U.ForgetRequest(request_.examples, (request_.shards[0],)))


def test_subtraction_is_the_composition_of_the_remaining_shards(
    s: Setup, index: ShardIndex, deltas: list, request_: U.ForgetRequest
) -> None:
    composed, parts, cost = U.forget_taft(s.make, deltas, index, request_, s.cached, s.y, CFG, retrain=False)
    others = [d for k, d in enumerate(deltas) if k not in request_.shards]
    assert len(parts) == S - 2 and all(p is d for p, d in zip(parts, others, strict=True))
    assert _max_diff(composed, _by_hand(others)) <= 1e-12
    assert (cost.steps, cost.sample_gradients, cost.models_trained) == (0, 0, 0) and cost.seconds < 1.0
    everything = U.ForgetRequest(tuple(int(index.shards[k][0]) for k in range(S)), tuple(range(S)))
    with pytest.raises(DataError, match="every one of the 4 shards"):
        U.forget_taft(s.make, deltas, index, everything, s.cached, s.y, CFG, retrain=False)


def test_shard_retraining_equals_training_without_the_forgotten(
    s: Setup, index: ShardIndex, deltas: list, request_: U.ForgetRequest
) -> None:
    composed, parts, cost = U.forget_taft(s.make, deltas, index, request_, s.cached, s.y, CFG)
    rest = U.remaining(index, request_)
    reduced = ShardIndex(tuple(rest.get(k, shard) for k, shard in enumerate(index.shards)))
    reference = train_shards(s.make, s.cached, s.y, reduced, CFG)  # every shard trained from scratch without them
    assert _max_diff(composed, _by_hand(reference)) <= 1e-12
    assert all(_max_diff(p, r) == 0.0 for p, r in zip(parts, reference, strict=True))  # shard order kept
    kept = [int(rest[k].numel()) for k in request_.shards]
    assert cost.models_trained == 2 and 0 < cost.cpu_seconds and 0 < cost.seconds
    assert cost.steps == sum(CFG.epochs * math.ceil(n / CFG.batch_size) for n in kept)
    assert cost.sample_gradients == CFG.epochs * sum(kept)
    h, y = _scrambled(s, request_)  # what the forgotten examples hold cannot change the result
    again, _, _ = U.forget_taft(s.make, deltas, index, request_, h, y, CFG)
    assert _max_diff(again, composed) == 0.0


def test_a_shard_forgotten_whole_is_dropped_not_retrained(s: Setup, index: ShardIndex, deltas: list) -> None:
    whole = U.ForgetRequest(tuple(sorted(index.shards[1].tolist())), (1,))
    composed, parts, cost = U.forget_taft(s.make, deltas, index, whole, s.cached, s.y, CFG)
    assert cost.models_trained == 0 and len(parts) == S - 1
    assert _max_diff(composed, _by_hand([d for k, d in enumerate(deltas) if k != 1])) <= 1e-12


def test_sisa_retrains_or_drops_the_affected_members(s: Setup, index: ShardIndex, request_: U.ForgetRequest) -> None:
    head = X.make_head(32, C, seed=0)
    members = train_nonlinear_shards(s.backbone, head, s.cached, s.y, index, NLFT)
    out, cost = U.forget_sisa(s.backbone, head, members, index, request_, s.cached, s.y, NLFT)
    assert len(out) == S and cost.models_trained == 2 and cost.sample_gradients == NLFT.epochs * (N // S * 2 - 3)
    for k, m in enumerate(out):
        if k not in request_.shards:
            assert m is members[k]
            continue
        keep = U.remaining(index, request_)[k]
        ref, _ = train_nonlinear(s.backbone, head, s.cached[keep], s.y[keep], replace(NLFT, seed=NLFT.seed + k))
        assert torch.equal(m.forward_from_cache(s.cached), ref.forward_from_cache(s.cached))
    h, y = _scrambled(s, request_)
    again, _ = U.forget_sisa(s.backbone, head, members, index, request_, h, y, NLFT)
    assert all(
        torch.equal(a.forward_from_cache(s.cached), b.forward_from_cache(s.cached))
        for a, b in zip(again, out, strict=True)
    )
    dropped, free = U.forget_sisa(s.backbone, head, members, index, request_, s.cached, s.y, NLFT, retrain=False)
    assert [m for m in members if m not in dropped] == [members[k] for k in request_.shards]
    assert (free.steps, free.models_trained) == (0, 0)


def test_full_retraining_trains_once_on_everything_else(s: Setup, request_: U.ForgetRequest) -> None:
    model, cost = U.full_retrain(s.make, s.cached, s.y, request_, CFG)
    keep = [i for i in range(N) if i not in request_.examples]
    ref = s.make()
    train_tangent(ref, s.cached[keep], s.y[keep], CFG)
    assert _max_diff(model.get_delta(), ref.get_delta()) == 0.0
    assert cost.steps == CFG.epochs * math.ceil((N - 3) / CFG.batch_size) and cost.sample_gradients == 2 * (N - 3)
    h, y = _scrambled(s, request_)
    again, _ = U.full_retrain(s.make, h, y, request_, CFG)
    assert _max_diff(again.get_delta(), model.get_delta()) == 0.0
    with pytest.raises(DataError, match=r"examples \[40\] outside the 32"):
        U.full_retrain(s.make, s.cached, s.y, U.ForgetRequest((40,), (0,)), CFG)


def test_inference_counts_one_forward_per_member_and_batch(s: Setup, deltas: list) -> None:
    members = [NonlinearSuffix(s.backbone, X.make_head(32, C, seed=j).double(), 1) for j in range(3)]
    logits, cost = U.measure_inference(members, s.cached, batch_size=10, repeats=3, reference=members[0])
    assert cost.batches == 4 and cost.forwards == 3 and cost.seconds_per_batch > 0  # the reference is not counted
    assert 1.0 < cost.over_reference < 10.0  # three forwards against one, timed side by side
    assert torch.allclose(logits, ensemble_logits([X.logits_of(m, s.cached) for m in members]), atol=1e-12)
    composed = s.make()
    composed.set_delta(_by_hand(deltas))
    logits, cost = U.measure_inference([composed], s.cached, batch_size=32)
    assert cost.batches == 1 and cost.forwards == 1 and math.isnan(cost.over_reference)
    assert torch.equal(logits, composed.forward_from_cache(s.cached))
    counter = U.ForwardCounter(composed)
    counter.forward_from_cache(s.cached[:2])
    counter.forward_from_cache(s.cached[:2])
    assert counter.calls == 2
    with pytest.raises(ConfigError, match="at least one model"):
        U.measure_inference([], s.cached)
