"""The secure-inference methods as registry entries: which model each runs, with which MPC nonlinearities
and which generation procedure, and the plaintext twin of each (the decrypted MPC output must equal it).

| method | model | under MPC | generation |
|---|---|---|---|
| ``vanilla`` | fine-tuned GPT-2 | exact softmax, GELU, LayerNorm | whole sequence per step (the baseline) |
| ``vanilla_kv`` | fine-tuned GPT-2 | exact | KV cache: only the new position per step (stronger baseline) |
| ``mpcformer_2relu`` | distilled student | softmax -> 2ReLU, GELU -> quad | as vanilla |
| ``mpcformer_2quad`` | distilled student | softmax -> 2Quad (c = 5), GELU -> quad | as vanilla |
| ``thex`` | distilled student | softmax -> ReLU(x + 3) normalised, GELU -> ReLU, LayerNorm -> x*g+b | as vanilla |
| ``merge_er`` | ER-trained GPT-2 | exact | embedding resending (eq. 3): no token selection or lookup per step |
| ``merge_mm`` | merge module of the fine-tuned model | constant attention, merged products (eq. 10-11) | as vanilla |
| ``merge`` | merge module from the ER model | constant attention, merged products | embedding resending (MERGE) |

``payload`` is a :class:`core.mpc.gpt2.GPT2Weights` (GPT-2) or :class:`core.mpc.t5.T5Weights` (T5) for the
``gpt2`` engine (the model as trained, with the method's nonlinearities) and a
:class:`core.mpc.merge_spec.MergeSpec` or :class:`core.mpc.t5_merge.T5MergeSpec` for the ``merge`` engine; the
payload's type says which architecture runs; a LLaMA-architecture decoder
(:class:`core.mpc.llama.LlamaWeights`, SmolLM2) runs the ``gpt2``-engine methods and its merge module
(:class:`core.mpc.llama_merge.LlamaMergeSpec`) the ``merge``-engine ones. On T5 the exact methods keep the model's
own FFN nonlinearity (ReLU or GELU, gated or not) and the approximations replace it, as on GPT-2; on LLaMA they
replace the SwiGLU gate's SiLU, and THE-X's norm is RMSNorm's ``x * g`` (:mod:`core.mpc.approx_llama`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from core.errors import ConfigError
from core.mpc import gpt2 as G
from core.mpc import gpt2_merge as GM
from core.mpc import llama as LL
from core.mpc import llama_merge as LLM
from core.mpc import t5 as T5
from core.mpc import t5_merge as T5M
from core.mpc.merge_spec import MergeSpec, merge_generate_plain, mm_generate_plain
from core.registry import lookup

__all__ = ["METHODS", "MethodSpec", "generate_plain", "method_spec", "run_method_party"]


@dataclass(frozen=True)
class MethodSpec:
    """``engine``: ``gpt2`` or ``merge``; ``mode``: the engine's generation mode; ``variant``: the MPC
    nonlinearities (gpt2 engine); ``approx``: the :mod:`core.mpc.approx` registry name its student is
    distilled with (None: no distillation); ``model``: which trained model it runs (``finetuned``,
    ``distilled``, ``er``, ``mm``, ``merge``)."""

    name: str
    engine: str
    mode: str
    model: str
    variant: G.MPCVariant | None = None
    approx: str | None = None


METHODS: dict[str, MethodSpec] = {
    "vanilla": MethodSpec("vanilla", "gpt2", "vanilla", "finetuned", G.MPCVariant()),
    "vanilla_kv": MethodSpec("vanilla_kv", "gpt2", "vanilla_kv", "finetuned", G.MPCVariant()),
    "mpcformer_2relu": MethodSpec(
        "mpcformer_2relu",
        "gpt2",
        "vanilla",
        "distilled",
        G.MPCVariant(softmax="2relu", activation="quad", softmax_c=0.0),
        "mpcformer_2relu",
    ),
    "mpcformer_2quad": MethodSpec(
        "mpcformer_2quad",
        "gpt2",
        "vanilla",
        "distilled",
        G.MPCVariant(softmax="2quad", activation="quad", softmax_c=5.0),
        "mpcformer_2quad",
    ),
    "thex": MethodSpec(
        "thex",
        "gpt2",
        "vanilla",
        "distilled",
        G.MPCVariant(softmax="2relu", activation="relu", norm="approx", softmax_c=3.0),
        "thex",
    ),
    "merge_er": MethodSpec("merge_er", "gpt2", "vanilla_er", "er", G.MPCVariant()),
    "merge_mm": MethodSpec("merge_mm", "merge", "mm", "mm"),
    "merge": MethodSpec("merge", "merge", "merge", "merge"),
}


def method_spec(name: str) -> MethodSpec:
    """The registry entry of ``name``; ConfigError listing the known methods otherwise."""
    return lookup("secure-inference method", METHODS, name)


def run_method_party(
    ctx: Any, method: str, payload: Any, prefix_ids: torch.Tensor | None, n_new: int, shape: tuple[int, int]
) -> G.GenerationResult:
    """One party's share of an encrypted generation with ``method`` (call inside ``parties.run_local``).

    ``prefix_ids`` (B, N) is used only by the client (party 1); the model owner (party 0) passes its
    ``payload`` (the other party's copy is ignored: it receives shares)."""
    spec = method_spec(method)
    ids = prefix_ids if ctx.is_client else None
    if spec.engine == "merge":
        if isinstance(payload, T5M.T5MergeSpec):
            merged = T5M.EncryptedT5Merge(payload, rank=ctx.rank, device=ctx.device)
            return merged.generate(ids, n_new, mode=spec.mode, shape=shape)
        if isinstance(payload, LLM.LlamaMergeSpec):
            merged = LLM.EncryptedLlamaMerge(payload, rank=ctx.rank, device=ctx.device)
            return merged.generate(ids, n_new, mode=spec.mode, shape=shape)
        if not isinstance(payload, MergeSpec):
            raise ConfigError(
                f"method {method!r} runs a MergeSpec, T5MergeSpec or LlamaMergeSpec, got {type(payload).__name__}"
            )
        return GM.EncryptedMerge(payload, rank=ctx.rank, device=ctx.device).generate(
            ids, n_new, mode=spec.mode, shape=shape
        )
    if isinstance(payload, T5.T5Weights):
        return T5.EncryptedT5(payload, spec.variant, rank=ctx.rank, device=ctx.device).generate(
            ids, n_new, mode=spec.mode, shape=shape
        )
    if isinstance(payload, LL.LlamaWeights):
        return LL.EncryptedLlama(payload, spec.variant, rank=ctx.rank, device=ctx.device).generate(
            ids, n_new, mode=spec.mode, shape=shape
        )
    if not isinstance(payload, G.GPT2Weights):
        raise ConfigError(
            f"method {method!r} runs GPT2Weights, T5Weights or LlamaWeights, got {type(payload).__name__}"
        )
    model = G.EncryptedGPT2(payload, spec.variant, rank=ctx.rank, device=ctx.device)
    return model.generate(ids, n_new, mode=spec.mode, shape=shape)


def generate_plain(method: str, payload: Any, prefix_ids: torch.Tensor, n_new: int) -> torch.Tensor:
    """The plaintext twin of :func:`run_method_party` (same model, same approximations, same procedure):
    greedy tokens (B, n_new)."""
    spec = method_spec(method)
    with torch.no_grad():
        if isinstance(payload, T5M.T5MergeSpec):
            return T5M.merge_generate_plain(payload, prefix_ids, n_new, mode=spec.mode)
        if isinstance(payload, LLM.LlamaMergeSpec):
            return LLM.merge_generate_plain(payload, prefix_ids, n_new, mode=spec.mode)
        if isinstance(payload, T5.T5Weights):
            return T5.plaintext_reference(payload, spec.variant, prefix_ids, n_new, mode=spec.mode)
        if isinstance(payload, LL.LlamaWeights):
            return LL.plaintext_reference(payload, spec.variant, prefix_ids, n_new, mode=spec.mode)
        if spec.engine == "merge":
            if spec.mode == "mm":
                return mm_generate_plain(payload, prefix_ids, n_new)
            return merge_generate_plain(payload, payload.lm_head[prefix_ids], n_new)[0]
        return G.plaintext_reference(payload, spec.variant, prefix_ids, n_new, mode=spec.mode)
