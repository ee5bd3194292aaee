"""The secure-inference stage's per-model training tasks: the model plan, one run per model, and a rerun that
reuses a model trained before (same config, data and teacher) instead of training it again."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import tasks.secure_inference as si
import tasks.secure_inference_models as sim
from core.errors import ConfigError
from core.mpc import recipes
from core.mpc.accounting import CATEGORIES
from core.mpc.gpt2 import GenerationResult
from core.mpc.payloads import payload_params, random_payload
from core.mpc.recipes import Curve
from core.mpc.run_costs import EncryptedRun, aggregate_parties
from pbconfig.base import ModelShape
from pbconfig.secure_inference import SecureInferenceConfig
from storage.recording import record_run
from storage.repository import ResultsRepository
from tests.flows.test_secure_inference_flow import TINY as FLOW_TINY

# the flow test's tiny config, with fewer training steps and no quality prompts
TINY = SecureInferenceConfig(**{**FLOW_TINY.model_dump(), "train_steps": 3, "quality_prompts": 0})


def _parent():
    with record_run(
        flow="secure-inference", stage="secure-inference", technique="flow", config={}, track=False
    ) as parent:
        pass
    return parent.ref


def test_the_plan_names_each_model_after_its_teacher() -> None:
    assert sim.models_needed(TINY) == ["finetuned", "distilled-mpcformer_2quad", "er", "merge"]
    only = TINY.model_copy(update={"methods": ("merge_mm", "thex", "merge_er")})
    assert sim.models_needed(only) == ["finetuned", "distilled-thex", "er", "mm"]
    assert [sim.teacher_of(n) for n in ("finetuned", "distilled-thex", "er", "mm", "merge")] == [
        None,
        "finetuned",
        "finetuned",
        "finetuned",
        "er",
    ]
    assert sim.model_of("vanilla_kv") == "finetuned" and sim.model_of("mpcformer_2relu") == "distilled-mpcformer_2relu"
    with pytest.raises(ConfigError, match=r"model kind .lora.; known: pretrained, finetuned, distilled"):
        sim.teacher_of("lora-1")


def test_a_rerun_reuses_the_trained_models(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parent = _parent()
    cfg = TINY.model_copy(update={"methods": ("vanilla", "merge_mm")})
    first = si.train_model.fn("finetuned", cfg, parent)
    mm = si.train_model.fn("mm", cfg, parent, teacher=first)
    assert (Path(first.path) / "state.pt").is_file() and (Path(mm.path) / "payload.pt").is_file()
    with pytest.raises(ConfigError, match="trained from 'finetuned'"):
        si.train_model.fn("mm", cfg, parent)

    def no_training(*args: object) -> None:
        raise AssertionError("a model of the cache was trained again")

    kinds = {k: replace(v, train=no_training) for k, v in sim.MODEL_KINDS.items()}
    monkeypatch.setattr(sim, "MODEL_KINDS", kinds)
    again = si.train_model.fn("finetuned", cfg, parent)
    assert again == first and si.train_model.fn("mm", cfg, parent, teacher=again) == mm
    with pytest.raises(AssertionError, match="trained again"):  # another lr: another model
        si.train_model.fn("mm", cfg.model_copy(update={"mm_lr": 2e-3}), parent, teacher=again)

    repo = ResultsRepository()
    _, rows = repo.query("select id, technique, status from runs where technique != 'flow' order by started_at")
    assert [(t, s) for _, t, s in rows] == [
        ("lm-train", "finished"),
        ("merge-mm-train", "finished"),
        ("lm-train", "finished"),
        ("merge-mm-train", "finished"),
        ("merge-mm-train", "failed"),
    ]
    runs = [repo.get_run(r) for r, _, _ in rows[:4]]
    for before, after in ((runs[0], runs[2]), (runs[1], runs[3])):  # the rerun records the same training
        assert {m["name"] for m in before["metrics"]} == {m["name"] for m in after["metrics"]}
    assert {m["name"] for m in runs[0]["metrics"]} == {"train_loss", "train_s", "test_loss", "n_parameters"}

    models = si.collect_models.fn(cfg, {"finetuned": first, "mm": mm}, parent)
    assert models.payloads == {
        "vanilla": str(Path(first.path) / "payload.pt"),
        "merge_mm": str(Path(mm.path) / "payload.pt"),
    }
    prompts = torch.load(models.prompts_path, weights_only=False)
    assert prompts["prefix"].shape == (2, 3) and prompts["table"].shape[1] == cfg.n_embd


def test_pretraining_is_the_fine_tuned_models_teacher(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pretrain = {"pretrain_corpora": ("chatterbot",), "pretrain_steps": 2, "pretrain_len": 16, "pretrain_eval_every": 1}
    cfg = SecureInferenceConfig(**{**TINY.model_dump(), "methods": ("vanilla",), **pretrain})
    assert sim.models_needed(cfg) == ["pretrained", "finetuned"]
    assert (sim.teacher_of("finetuned", cfg), sim.teacher_of("pretrained", cfg), sim.teacher_of("finetuned")) == (
        "pretrained",
        None,
        None,
    )
    parent = _parent()
    pre = si.train_model.fn("pretrained", cfg, parent)
    with pytest.raises(ConfigError, match="'finetuned' is trained from 'pretrained', got teacher None"):
        si.train_model.fn("finetuned", cfg, parent)
    monkeypatch.setattr(recipes, "finetune_lm", lambda *a, **k: [0.0])  # no fine-tuning: the start is what is left
    fine = si.train_model.fn("finetuned", cfg, parent, teacher=pre)
    start, end = (torch.load(Path(r.path) / "state.pt", weights_only=True) for r in (pre, fine))
    assert all(torch.equal(start[k], end[k]) for k in start)
    no_pretraining = cfg.model_copy(update={"pretrain_steps": 0, "pretrain_corpora": ()})
    scratch = si.train_model.fn("finetuned", no_pretraining, parent)
    assert scratch.key != fine.key and not torch.equal(
        torch.load(Path(scratch.path) / "state.pt", weights_only=True)["transformer.wte.weight"],
        end["transformer.wte.weight"],
    )

    repo = ResultsRepository()
    _, rows = repo.query("select id from runs where technique = 'lm-pretrain'")
    run = repo.get_run(rows[0][0])
    metrics = {m["name"]: m["value"] for m in run["metrics"]}
    assert metrics["val_loss_full_vocab"] >= metrics["val_loss"] > 0
    assert metrics["val_perplexity"] == pytest.approx(math.exp(metrics["val_loss"]), rel=1e-6)
    blocks = metrics["train_tokens"] + metrics["val_tokens"]  # whole blocks of 16: the last partial one dropped
    assert blocks % 16 == 0 and blocks <= metrics["tokens.chatterbot"] < blocks + 16
    assert 0 < metrics["pretrain_vocab"] < 50257 and metrics["epochs"] > 0
    query = f"select step from metrics where run_id = '{run['id']}' and name = 'val_loss_curve' order by step"
    _, steps = repo.query(query)
    assert [s for (s,) in steps] == [1, 2]


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ({"pretrain_steps": 5}, r"pretrain_steps=5 with pretrain_corpora=\[\]: pretraining needs both"),
        ({"pretrain_corpora": ("kjv",)}, r"pretrain_steps=0 with pretrain_corpora=\['kjv'\]"),
        ({"pretrain_steps": 5, "pretrain_corpora": ("kjv", "kjv")}, "must be distinct"),
        ({"pretrain_steps": 5, "pretrain_corpora": ("kjv",), "pretrain_len": 64}, "pretrain_len=64 exceeds n_posit"),
        ({"n_prompts": 4, "quality_prompts": 3}, r"quality_prompts=3 is below n_prompts=4.*set it to 0"),
    ],
)
def test_bad_pretraining_settings_are_named(update: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SecureInferenceConfig(**{**TINY.model_dump(), **update})


def test_a_pretrain_seed_shares_one_pretrained_model_across_seed_passes(home: Path) -> None:
    pretrain = {"pretrain_corpora": ("chatterbot",), "pretrain_steps": 2, "pretrain_len": 16, "pretrain_eval_every": 1}
    base = SecureInferenceConfig(**{**TINY.model_dump(), "methods": ("vanilla",), **pretrain, "seeds": (0, 1)})
    data_hash = sim.pretrain_data_of(base).content_hash

    def keys(cfg: SecureInferenceConfig) -> list[str]:
        return [sim.model_key("pretrained", c, data_hash, None) for c in cfg.seed_configs()]

    own = keys(base)  # no pretrain_seed: each pass pretrains with its own seed
    assert own[0] != own[1]
    shared = keys(base.model_copy(update={"pretrain_seed": 0}))
    assert shared[0] == shared[1] == own[0]  # seed 0's own model is the shared one: the same inputs, the same key
    assert keys(base.model_copy(update={"pretrain_seed": 1}))[0] == own[1]
    passes = base.model_copy(update={"pretrain_seed": 0}).seed_configs()
    assert [c.pretrain_seed_used for c in passes] == [0, 0] and [c.seed for c in passes] == [0, 1]

    parent = _parent()
    first, second = (si.train_model.fn("pretrained", c, parent) for c in passes)
    assert first.path == second.path  # trained once, reused by the second pass
    fine = [si.train_model.fn("finetuned", c, parent, teacher=first) for c in passes]
    assert fine[0].key != fine[1].key  # each pass fine-tunes with its own seed
    repo = ResultsRepository()
    _, rows = repo.query("select config_json from runs where technique = 'lm-pretrain' order by started_at")
    assert ['"seed": 0' in c or '"seed":0' in c for (c,) in rows] == [True, True]


def test_a_negative_pretrain_seed_is_refused() -> None:
    with pytest.raises(ValueError, match="pretrain_seed"):
        SecureInferenceConfig(**{**TINY.model_dump(), "pretrain_seed": -1})


def test_seed_passes_alternate_the_method_order() -> None:
    """A timing ratio must not favour the method that always runs first: consecutive seed passes run the methods
    in opposite orders, so every pair runs both ways."""
    base = SecureInferenceConfig(
        **{**TINY.model_dump(), "methods": ("vanilla", "vanilla_kv", "merge"), "seeds": (0, 1, 2)}
    )
    orders = [c.run_order for c in base.seed_configs()]
    assert orders == [("vanilla", "vanilla_kv", "merge"), ("merge", "vanilla_kv", "vanilla"), orders[0]]
    for a in base.methods:  # every ordered pair of methods appears in both orders over two passes
        for b in base.methods:
            if a != b:
                firsts = {o.index(a) < o.index(b) for o in orders[:2]}
                assert firsts == {True, False}, (a, b)


def test_curves_round_trip_through_the_manifest_and_record_as_before() -> None:
    per_step = Curve.per_step([float(i) for i in range(25)])
    val = Curve.at_steps([(5, 2.0), (10, 1.5)])
    assert sim.curve_json(val) == [[5, 2.0], [10, 1.5]] and sim.curve_json(per_step) == list(per_step.values)
    assert sim.curve_from_json(sim.curve_json(val)) == val and sim.curve_from_json(sim.curve_json(per_step)) == per_step
    assert sim.curve_from_json([{"total": 3.0, "align": 1.0}, 2]) == Curve((3.0, 2.0))  # an older manifest's entries

    class Rec:
        def __init__(self) -> None:
            self.seen: list[tuple[str, float, int]] = []

        def metric(self, name: str, value: float, *, step: int) -> None:
            self.seen.append((name, value, step))

    rec = Rec()
    sim.record_curve(rec, "train_loss", per_step)  # every 10th step and the last
    sim.record_curve(rec, "val_loss_curve", val)  # whole, at its steps
    assert rec.seen == [
        ("train_loss", 0.0, 0),
        ("train_loss", 10.0, 10),
        ("train_loss", 20.0, 20),
        ("train_loss", 24.0, 24),
        ("val_loss_curve", 2.0, 5),
        ("val_loss_curve", 1.5, 10),
    ]


def _fake_run(tokens: torch.Tensor) -> EncryptedRun:
    costs = {c: {"s": 0.1, "bytes": 8, "rounds": 1, "calls": 1} for c in CATEGORIES}
    parties = [
        GenerationResult(r, "merge", tokens if r == 1 else None, costs, total_s=1.0, comm_bytes=80, rounds=7)
        for r in (0, 1)
    ]
    return aggregate_parties(parties, wall_s=2.0)


def test_the_model_and_scaling_tasks_leave_the_global_rng_alone(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A task draws from its config's seed through core (``core.mpc.recipes.seeded``): the process-wide RNG is
    the same after it (the scaling task once reseeded it for its random model)."""
    parent = _parent()
    cfg = TINY.model_copy(update={"methods": ("vanilla", "merge_mm")})
    torch.manual_seed(1234)
    before = torch.random.get_rng_state().clone()
    fine = si.train_model.fn("finetuned", cfg, parent)
    models = si.collect_models.fn(
        cfg, {"finetuned": fine, "mm": si.train_model.fn("mm", cfg, parent, teacher=fine)}, parent
    )
    assert torch.equal(torch.random.get_rng_state(), before)

    ran: list[object] = []

    def run_encrypted(method: str, payload: object, prefix: torch.Tensor, n_new: int, cfg: object) -> EncryptedRun:
        ran.append(payload)
        return _fake_run(torch.zeros(prefix.shape[0], n_new, dtype=torch.long))

    monkeypatch.setattr(si, "run_encrypted", run_encrypted)
    shape = ModelShape(n_layer=1, n_embd=8, n_head=2)
    point = si.scaling_point.fn("merge", 1, shape, cfg, models, parent)
    assert torch.equal(torch.random.get_rng_state(), before)
    want = random_payload("merge", sim.gpt2_shape(cfg, sim.EOS + 1, shape), n_max=cfg.n_max, seed=cfg.seed)
    assert torch.equal(ran[0].lm_head, want.lm_head)
    assert point["n_parameters"] == payload_params(want) and point["model"] == "L1-d8-h2"
    assert (point["total_s"], point["comm_bytes"], point["rounds"]) == (1.0, 80, 7)
