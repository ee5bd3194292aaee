"""Every encrypted primitive against its plaintext twin, tolerances per op (16-bit fixed point)."""

from __future__ import annotations

import pytest
import torch

from core.errors import ConfigError
from core.mpc import ops
from core.mpc.accounting import CostMeter
from core.mpc.parties import run_local

from .conftest import require_crypten

require_crypten()

# |encrypted - plaintext| bounds, measured on these inputs with margin (see core/mpc/ops.py docstring).
TOL = {
    "embed": 1e-4,
    "linear": 1e-3,
    "ln_exact": 1e-2,
    "ln_approx": 1e-3,
    "sm_exact": 1e-2,
    "sm_2relu": 1e-2,
    "sm_2quad": 1e-2,
    "act_gelu": 1e-2,
    "act_gelu_large": 2e-2,
    "act_quad": 1e-3,
    "act_relu": 1e-4,
}


def _job(ctx):
    g = torch.Generator().manual_seed(0)
    m, r = CostMeter(), ctx.rank
    sh = lambda t, src=1: ops.share(t, src=src, rank=r)
    out = {}
    ids = torch.randint(0, 20, (2, 5), generator=g)
    table = torch.randn(20, 8, generator=g)
    out["embed"] = (ops.embed(sh(ops.onehot(ids, 20)), sh(table, 0), m).get_plain_text(), table[ids])
    x, w, b = torch.randn(2, 5, 8, generator=g), torch.randn(8, 12, generator=g) * 0.3, torch.randn(12, generator=g)
    out["linear"] = (ops.linear(sh(x), sh(w, 0), sh(b, 0), m).get_plain_text(), x @ w + b)
    gam, bet = 1 + 0.1 * torch.randn(8, generator=g), 0.1 * torch.randn(8, generator=g)
    for kind in ops.NORMS:
        enc = ops.layer_norm(sh(x), sh(gam, 0), sh(bet, 0), m, kind=kind).get_plain_text()
        out[f"ln_{kind}"] = (enc, ops.plain_layer_norm(x, gam, bet, kind=kind))
    s = torch.randn(2, 2, 6, 6, generator=g) * 2
    mask = ops.causal_mask(6, 6)
    for kind in ops.SOFTMAXES:
        out[f"sm_{kind}"] = (
            ops.softmax(sh(s), m, kind=kind, mask=mask).get_plain_text(),
            ops.plain_softmax(s, kind=kind, mask=mask),
        )
    a = torch.linspace(-6, 6, 97)
    for kind in ("gelu", "quad", "relu"):
        out[f"act_{kind}"] = (ops.activation(sh(a), m, kind=kind).get_plain_text(), ops.plain_activation(a, kind=kind))
    # pre-activations of +-30 (trained merge modules reach 20): tanh's argument ~ +-1000 must not overflow
    big = torch.linspace(-30, 30, 61)
    out["act_gelu_large"] = (
        ops.activation(sh(big), m, kind="gelu").get_plain_text(),
        ops.plain_activation(big, kind="gelu"),
    )
    logits = torch.randn(3, 1, 40, generator=g)
    out["argmax"] = (ops.argmax_onehot(sh(logits), m).get_plain_text(), logits)
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    return run_local(_job, timeout_s=120)[0]


@pytest.mark.parametrize("name", sorted(TOL))
def test_encrypted_op_matches_plaintext(results: dict, name: str) -> None:
    enc, ref = results[name]
    assert enc.shape == ref.shape
    assert (enc - ref).abs().max().item() <= TOL[name], name


def test_softmax_masks_future_keys_exactly(results: dict) -> None:
    enc, _ = results["sm_exact"]
    assert enc.triu(1).abs().max().item() == 0.0
    assert torch.allclose(enc.sum(-1), torch.ones(enc.shape[:-1]), atol=1e-2)


def test_argmax_is_an_encrypted_one_hot(results: dict) -> None:
    onehot, logits = results["argmax"]
    assert onehot.shape == logits.shape
    assert torch.equal(onehot.sum(-1), torch.ones(3, 1))
    assert torch.equal(onehot.argmax(-1), logits.argmax(-1))


@pytest.mark.parametrize(
    ("fn", "kind"),
    [(ops.plain_softmax, "softmax"), (ops.plain_activation, "activation"), (ops.plain_layer_norm, "norm")],
)
def test_unknown_kind_lists_known(fn, kind) -> None:
    args = (torch.ones(2, 2),) if kind != "norm" else (torch.ones(2, 2), torch.ones(2), torch.zeros(2))
    with pytest.raises(ConfigError, match="known: ") as err:
        fn(*args, kind="cubic")
    assert "cubic" in str(err.value)
