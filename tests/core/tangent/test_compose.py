"""Composition by averaging deltas (eq. 13) and unlearning by subtraction (Sect. 3.3)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from core.errors import ConfigError, DataError
from core.tangent.compose import add_component, compose, ensemble_logits, remove_component

D = torch.float64


def _deltas(n: int, seed: int = 0) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"w": torch.randn(4, 3, generator=g, dtype=D), "b": torch.randn(3, generator=g, dtype=D)} for _ in range(n)]


def _flat(delta: dict[str, Tensor] | list[Tensor]) -> Tensor:
    ts = list(delta.values()) if isinstance(delta, dict) else list(delta)
    return torch.cat([t.flatten() for t in ts])


def test_compose_uniform_average_dict_and_list() -> None:
    ds = _deltas(3)
    out = compose(ds)
    assert isinstance(out, dict) and list(out) == ["w", "b"]
    torch.testing.assert_close(out["w"], (ds[0]["w"] + ds[1]["w"] + ds[2]["w"]) / 3, rtol=0, atol=1e-15)
    lists = [[d["w"], d["b"]] for d in ds]
    out_l = compose(lists)
    assert isinstance(out_l, list)
    torch.testing.assert_close(out_l[1], out["b"], rtol=0, atol=0)


def test_compose_weights() -> None:
    a, b = [torch.tensor([1.0], dtype=D)], [torch.tensor([4.0], dtype=D)]
    assert compose([a, b], [1.0, 2.0])[0].item() == pytest.approx(3.0)  # (1*1 + 2*4) / 3
    assert compose([a, b], torch.tensor([1.0, 2.0]), normalize=False)[0].item() == pytest.approx(9.0)
    assert compose([a, b], [1.0, -1.0], normalize=False)[0].item() == pytest.approx(-3.0)
    with pytest.raises(ConfigError, match="2 weights for 1"):
        compose([a], [1.0, 2.0])
    with pytest.raises(ConfigError, match=">= 0"):
        compose([a, b], [1.0, -1.0])
    with pytest.raises(ConfigError, match="sum to 0"):
        compose([a, b], [0.0, 0.0])


def test_compose_dict_key_order_independent() -> None:
    d1 = {"a": torch.ones(2, dtype=D), "b": torch.zeros(1, dtype=D)}
    d2 = {"b": torch.ones(1, dtype=D), "a": torch.zeros(2, dtype=D)}
    out = compose([d1, d2])
    torch.testing.assert_close(out["a"], torch.full((2,), 0.5, dtype=D))
    torch.testing.assert_close(out["b"], torch.full((1,), 0.5, dtype=D))


def test_structure_errors() -> None:
    with pytest.raises(ConfigError, match="non-empty"):
        compose([])
    with pytest.raises(DataError, match="missing"):
        compose([{"a": torch.ones(1)}, {"b": torch.ones(1)}])
    with pytest.raises(DataError, match=r"deltas\[1\]\[0\] has shape \(2,\), expected \(1,\)"):
        compose([[torch.ones(1)], [torch.ones(2)]])
    with pytest.raises(DataError, match="mixes list and dict"):
        compose([[torch.ones(1)], {"a": torch.ones(1)}])
    with pytest.raises(DataError, match="bare tensor"):
        compose([torch.ones(1)])  # type: ignore[list-item]
    with pytest.raises(DataError, match="floating"):
        compose([[torch.ones(1, dtype=torch.long)]])
    with pytest.raises(ConfigError, match="n_components=1"):
        remove_component([torch.ones(1)], [torch.ones(1)], 1)


@pytest.mark.parametrize("j", [0, 2, 4])
def test_remove_component_equals_average_of_rest(j: int) -> None:
    ds = _deltas(5, seed=j)
    composed = compose(ds)
    removed = remove_component(composed, ds[j], 5)
    rest = compose([d for i, d in enumerate(ds) if i != j])
    for k in ("w", "b"):
        assert (removed[k] - rest[k]).abs().max().item() < 1e-12
    readded = add_component(removed, ds[j], 4)
    for k in ("w", "b"):
        assert (readded[k] - composed[k]).abs().max().item() < 1e-12


def test_eq13_linear_in_delta_model() -> None:
    """f(w + d) = f(w) + J d: composing N deltas == averaging the N outputs; subtraction == never trained."""
    g = torch.Generator().manual_seed(7)
    B, C, N = 5, 3, 4
    params = 4 * 3 + 3
    f0 = torch.randn(B, C, generator=g, dtype=D)  # f_w(x) for a batch of B inputs
    J = torch.randn(B * C, params, generator=g, dtype=D)  # Jacobian of the flattened outputs

    def f_lin(delta: dict[str, Tensor]) -> Tensor:
        return f0 + (J @ _flat(delta)).view(B, C)

    ds = _deltas(N, seed=11)
    outs = [f_lin(d) for d in ds]
    composed = compose(ds)
    assert (ensemble_logits(outs) - f_lin(composed)).abs().max().item() < 1e-10
    w = [1.0, 2.0, 3.0, 4.0]
    assert (ensemble_logits(outs, w) - f_lin(compose(ds, w))).abs().max().item() < 1e-10

    forgotten = remove_component(composed, ds[1], N)
    never = [d for i, d in enumerate(ds) if i != 1]
    assert (f_lin(forgotten) - ensemble_logits([f_lin(d) for d in never])).abs().max().item() < 1e-10
    assert (f_lin(forgotten) - f_lin(compose(never))).abs().max().item() < 1e-10


def test_ensemble_logits_errors() -> None:
    with pytest.raises(ConfigError, match="non-empty"):
        ensemble_logits([])
    with pytest.raises(DataError, match=r"logits\[1\] has shape"):
        ensemble_logits([torch.zeros(2, 3), torch.zeros(3, 2)])
