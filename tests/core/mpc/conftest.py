"""Shared tiny models and ONE two-party run whose results several tests check (each local MPC run costs
process start-up plus thousands of loopback rounds, so the suite batches its encrypted work)."""

from __future__ import annotations

import pytest
import torch

from core.mpc import gpt2 as G
from core.mpc import gpt2_merge as GM
from core.mpc.crypten_compat import crypten_available
from core.mpc.merge_spec import MergedLayerSpec, MergeSpec

VOCAB, D, N_POS, PREFIX, NEW = 64, 16, 32, 4, 3
LONG_PREFIX = 12  # MERGE's per-step bytes are measured at PREFIX and LONG_PREFIX


def require_crypten() -> None:
    """Module-level skip for the encrypted tests only (the plaintext MPC tests here run without CrypTen)."""
    if not crypten_available():
        pytest.skip("CrypTen is not installed (pip install --no-deps crypten==0.4.1)", allow_module_level=True)


def tiny_gpt2(dtype: torch.dtype = torch.float64, seed: int = 0, d: int = 16):
    """The approximation and merge tests' GPT-2: 100 tokens, 2 layers of width ``d``, no dropout, eval mode."""
    from core.models.gpt2 import tiny_gpt2 as build

    torch.manual_seed(seed)
    model = build(100, n_layer=2, n_embd=d, n_head=2, n_positions=32, dropout=0.0, eos_token_id=0)
    return model.to(dtype).eval()


def tiny_hf():
    transformers = pytest.importorskip("transformers")
    GPT2Config, GPT2LMHeadModel = transformers.GPT2Config, transformers.GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_embd=D,
        n_layer=2,
        n_head=2,
        n_positions=N_POS,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg).eval()


def tiny_merge_spec(n_max: int = 16, heads: int = 2, d_i: int = 32) -> MergeSpec:
    g = torch.Generator().manual_seed(1)
    r = lambda *s, std=0.2: torch.randn(*s, generator=g) * std
    layers = []
    for _ in range(2):
        c = torch.rand(heads, n_max, n_max, generator=g).tril()
        c = c / c.sum(-1, keepdim=True)  # causal, row-stochastic
        layers.append(
            MergedLayerSpec(
                C=c,
                ln_gamma=1 + r(D),
                ln_beta=r(D),
                ln_eps=1e-5,
                W_V=r(D, D),
                W_d=r(D, D),
                b_a=r(D),
                M_u=r(D, d_i),
                b_u=r(d_i),
                W_O=r(d_i, D),
                b_O=r(D),
                act="gelu_new",
            )
        )
    return MergeSpec(
        layers=tuple(layers),
        wpe=r(N_POS, D),
        lnf_gamma=1 + r(D),
        lnf_beta=r(D),
        lnf_eps=1e-5,
        lm_head=r(VOCAB, D, std=0.5),
    )


@pytest.fixture(scope="session")
def hf_model():
    return tiny_hf()


@pytest.fixture(scope="session")
def weights(hf_model) -> G.GPT2Weights:
    return G.weights_from_hf(hf_model)


@pytest.fixture(scope="session")
def prefix() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, PREFIX), generator=torch.Generator().manual_seed(3))


def long_prefix() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, LONG_PREFIX), generator=torch.Generator().manual_seed(4))


def _two_party_job(ctx, w, ids, spec):
    out = {}
    model = G.EncryptedGPT2(w, G.MPCVariant(), rank=ctx.rank)
    x = model.share_prefix(ids if ctx.is_client else None, tuple(ids.shape))
    out["logits"] = model.forward(x).get_plain_text()
    for mode in G.GENERATION_MODES:
        out[mode] = model.generate(ids if ctx.is_client else None, NEW, mode=mode, shape=tuple(ids.shape))
    merged = GM.EncryptedMerge(spec, rank=ctx.rank)
    out["merge"] = merged.generate(ids if ctx.is_client else None, NEW, shape=tuple(ids.shape))
    out["mm"] = merged.generate(ids if ctx.is_client else None, NEW, mode="mm", shape=tuple(ids.shape))
    out["merge_recompute"] = merged.generate(
        ids if ctx.is_client else None, NEW, shape=tuple(ids.shape), recompute=True
    )
    long_ids = long_prefix()
    out["merge_long"] = merged.generate(long_ids if ctx.is_client else None, NEW, shape=tuple(long_ids.shape))
    return out


@pytest.fixture(scope="session")
def two_party(weights: G.GPT2Weights, prefix: torch.Tensor) -> list[dict]:
    """One ``run_local`` (2 processes): forward logits, generation in every mode, MERGE generation (incremental,
    recomputed, and at a longer prefix)."""
    from core.mpc.parties import run_local

    require_crypten()
    return run_local(_two_party_job, (weights, prefix, tiny_merge_spec()), timeout_s=240)
