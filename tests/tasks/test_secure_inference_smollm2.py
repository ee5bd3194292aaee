"""The secure-inference stage on SmolLM2 (``secure_inference.base: smollm2``): the settings it refuses, and its
models trained, run under MPC and scored with SmolLM2's own tokenizer, recorded so that the claims read SmolLM2's
runs apart from GPT-2's. The released 135M model is replaced by a tiny LLaMA of the same vocabulary (the
tokenizer is the real one), so the wiring is tested in seconds; the real model under MPC is
``tests/core/mpc/test_llama.py``'s slow test."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

import tasks.secure_inference as si
import tasks.secure_inference_models as sim
from core.mpc import llama_merge
from core.mpc.crypten_compat import crypten_available
from core.mpc.llama import LlamaWeights
from core.mpc.recipes import SMOLLM2_EOS, SmolLM2Base
from pbconfig.claims import load_claims
from pbconfig.secure_inference import SecureInferenceConfig
from storage import views
from storage.claim_rows import matches
from storage.repository import ResultsRepository
from tests.tasks.test_secure_inference_models import _parent

VOCAB = 49152  # SmolLM2's tokenizer

SMOL = SecureInferenceConfig(
    base="smollm2",
    methods=("vanilla_kv", "merge_er", "merge"),
    n_positions=16,
    max_len=16,
    batch_size=8,
    max_pairs=400,
    train_steps=2,
    er_steps=2,
    mm_steps=2,
    prefix_len=3,
    gen_len=2,
    n_prompts=1,
    quality_prompts=3,
    scaling_gen_lens=(),
)


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ({"pretrain_steps": 5, "pretrain_corpora": ("kjv",), "pretrain_len": 16}, r"already pretrained: set"),
        ({"scaling_gen_lens": (4,)}, r"base=smollm2 runs no length-scaling points"),
        ({"base": "llama"}, r"base"),
    ],
)
def test_settings_smollm2_cannot_run_are_refused_by_name(update: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SecureInferenceConfig(**{**SMOL.model_dump(), **update})


def _tiny_llama() -> torch.nn.Module:
    """A LLaMA of SmolLM2's vocabulary and kind (grouped K/V heads, SiLU), the same weights each call; its head is
    untied (SmolLM2's is tied) so that it can favour a few tokens while every token's input row keeps its scale."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=SMOLLM2_EOS,
        pad_token_id=SMOLLM2_EOS,
        initializer_range=0.5,  # not 0.02: logits of one scale 1e-5 apart are a coin toss under fixed point
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model = LlamaForCausalLM(config).eval()
        # 64 tokens keep their head rows, the others' shrink 100-fold: the greedy token of a random model is then one
        # of the 64, ahead of the next by far more than the wide-range RMSNorm's error under MPC (up to 5e-3
        # relative), where among 49,152 rows of one scale the top two logits are often within it. The input rows
        # keep their scale: a shrunk one (mean square 2.5e-5) would be below the wide norm's range (from 1e-4;
        # SmolLM2's rows: ~0.018), and a method that looks the prompt up would normalise it wrongly under MPC
        with torch.no_grad():
            live = torch.randperm(VOCAB)[:64]
            scale = torch.full((VOCAB, 1), 0.01)
            scale[live] = 1.0
            model.lm_head.weight.mul_(scale)
        return model


def test_the_models_train_from_the_released_weights_with_smollm2s_tokenizer(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import core.stip.models as stip_models

    monkeypatch.setattr(stip_models, "load_smollm2", _tiny_llama)
    assert isinstance(sim.model_shape(SMOL, VOCAB), SmolLM2Base) and sim.eos_of(SMOL) == SMOLLM2_EOS
    data, vocab = sim.data_of(SMOL)
    assert vocab == VOCAB and int(data.ids.max()) < VOCAB  # SmolLM2's ids, padded with its EOS
    assert sim.models_needed(SMOL) == ["finetuned", "er", "merge"]
    parent = _parent()
    fine = si.train_model.fn("finetuned", SMOL, parent)
    er = si.train_model.fn("er", SMOL, parent, teacher=fine)
    mm = si.train_model.fn("merge", SMOL, parent, teacher=er)
    payloads = {r.name: torch.load(Path(r.path) / "payload.pt", weights_only=False) for r in (fine, er, mm)}
    assert isinstance(payloads["finetuned"], LlamaWeights) and isinstance(payloads["er"], LlamaWeights)
    assert isinstance(payloads["merge"], llama_merge.LlamaMergeSpec)
    start = _tiny_llama().state_dict()
    tuned = torch.load(Path(fine.path) / "state.pt", weights_only=True)
    assert not torch.equal(tuned["model.embed_tokens.weight"], start["model.embed_tokens.weight"])  # it trained
    # the same settings on GPT-2 name another model
    assert sim.model_key("finetuned", SMOL.model_copy(update={"base": "gpt2"}), "h", None) != sim.model_key(
        "finetuned", SMOL, "h", None
    )

    repo = ResultsRepository()
    _, rows = repo.query("select id, config_json from runs where technique = 'lm-train'")
    run = repo.get_run(rows[0][0])
    metrics = {m["name"]: m["value"] for m in run["metrics"]}
    assert metrics["start_test_loss"] > 0 and metrics["test_loss"] > 0
    assert json.loads(rows[0][1])["base"] == "smollm2"
    _, rows = repo.query("select config_json from runs where technique = 'merge-mm-train'")
    assert json.loads(rows[0][0])["mlp_norm"] == "rms"  # SmolLM2's merge module keeps the MLP's normalisation

    models = si.collect_models.fn(SMOL, {"finetuned": fine, "er": er, "merge": mm}, parent)
    prompts = torch.load(models.prompts_path, weights_only=False)
    assert prompts["table"].shape == (VOCAB, 16)


@pytest.mark.skipif(not crypten_available(), reason="CrypTen is not installed")
def test_smollm2_runs_decrypt_to_their_twins_and_the_claims_read_them_apart(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import core.stip.models as stip_models

    monkeypatch.setattr(stip_models, "load_smollm2", _tiny_llama)
    cfg = SMOL.model_copy(update={"methods": ("merge_er", "merge")})
    parent = _parent()
    fine = si.train_model.fn("finetuned", cfg, parent)
    er = si.train_model.fn("er", cfg, parent, teacher=fine)
    mm = si.train_model.fn("merge", cfg, parent, teacher=er)
    models = si.collect_models.fn(cfg, {"finetuned": fine, "er": er, "merge": mm}, parent)
    for method in cfg.methods:
        out = si.mpc_generation.fn(method, cfg, models, parent)
        assert out["agreement"] == 1.0  # decrypted tokens equal the plaintext twin's
        assert 0.0 <= out["quality"]["rouge_l"] <= 1.0

    quality = views.generation_quality()  # the report's quality table reads the runs' model and step counts
    assert sorted(quality["method"]) == ["merge", "merge_er"] and set(quality["base"]) == {"smollm2"}
    assert set(quality["model"]) == {sim.SMOLLM2_MODEL} and set(quality["agreement"]) == {1.0}
    assert quality.set_index("method").loc["merge", ["er_steps", "mm_steps"]].tolist() == [2, 2]
    assert pd.isna(quality.set_index("method").loc["merge_er", "mm_steps"])
    costs = views.mpc_costs()
    assert set(costs["base"]) == {"smollm2"}
    claims = {c.id: c for c in load_claims()}
    gpt2_only = claims["merge-speedup-over-vanilla"].measure.where
    assert not matches(costs, gpt2_only).any()  # the GPT-2 timing claims do not read SmolLM2's runs
    repo = ResultsRepository()
    _, rows = repo.query("select config_json from runs where technique = 'merge'")
    from storage.claim_rows import flat_config
    from storage.view_query import parse_config

    flat = [flat_config(parse_config(c)) for (c,) in rows]
    assert [f.get("config.base") for f in flat] == ["smollm2"]
    assert claims["merge-quality-close-to-plaintext-smollm2"].measure.where == {"config.base": "smollm2"}
    assert claims["merge-quality-close-to-plaintext"].measure.where == {"config.base": ["gpt2", None]}


@pytest.mark.skipif(not crypten_available(), reason="CrypTen is not installed")
def test_the_mpcformer_and_thex_students_distil_from_smollm2_and_decrypt_to_their_twins(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The students of SmolLM2 (core.mpc.approx_llama): distilled with the relative hidden loss and recorded; the
    2Quad one runs under MPC with its approximations (SiLU gate -> quad, softmax -> 2Quad). THE-X's student trains
    here, but its RMSNorm -> x * g leaves this random model's residual at ~3e5 after two blocks, where 2-party fixed
    point wraps; its decryption is tested on a model in range (tests/core/mpc/test_llama.py). The 2ReLU student is
    left out: on such a random model its decryption differs from its twin now and then, with the shares' draw (on
    the module's tiny LLaMA of tests/core/mpc/test_llama.py, 1 run in 3 flipped a token whose plaintext margin is
    3.1 logits, while each block's hidden states decrypt within 3e-3 of the twin's). Likely cause, not proven: 24%
    of its attention rows have a sum within 2x of 2ReLU's 1e-3 floor, so their reciprocals are near 1000, and
    2-party CrypTen's local truncation fails (a rare, huge error) with a probability that grows with the magnitude
    truncated; 2Quad's sums keep reciprocals near 1."""
    import core.stip.models as stip_models

    monkeypatch.setattr(stip_models, "load_smollm2", _tiny_llama)
    cfg = SMOL.model_copy(update={"methods": ("mpcformer_2relu", "mpcformer_2quad", "thex"), "distill_steps": 2})
    students = ["distilled-mpcformer_2relu", "distilled-mpcformer_2quad", "distilled-thex"]
    assert sorted(sim.models_needed(cfg)) == sorted(["finetuned", *students])
    parent = _parent()
    fine = si.train_model.fn("finetuned", cfg, parent)
    students = {n: si.train_model.fn(n, cfg, parent, teacher=fine) for n in sim.models_needed(cfg)[1:]}
    for ref in students.values():
        assert isinstance(torch.load(Path(ref.path) / "payload.pt", weights_only=False), LlamaWeights)
    repo = ResultsRepository()
    _, rows = repo.query("select technique, config_json from runs where technique like 'distill-%'")
    assert sorted(t for t, _ in rows) == ["distill-mpcformer_2quad", "distill-mpcformer_2relu", "distill-thex"]
    assert {json.loads(c)["hidden_loss"] for _, c in rows} == {"relative"}  # SmolLM2's scale-relative loss
    models = si.collect_models.fn(cfg, {"finetuned": fine, **students}, parent)
    out = si.mpc_generation.fn("mpcformer_2quad", cfg, models, parent)
    assert out["agreement"] == 1.0  # decrypted tokens equal the plaintext twin's
    quality = views.generation_quality()
    assert list(quality["method"]) == ["mpcformer_2quad"] and set(quality["base"]) == {"smollm2"}
