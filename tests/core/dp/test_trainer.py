"""DP-SGD trainer: every method runs, privacy is spent as planned, learning works, errors are clear."""

from __future__ import annotations

import math
import secrets

import numpy as np
import pytest
import torch

from core.data.sequential import SequentialDataset
from core.dp import trainer
from core.dp.accounting import default_delta
from core.dp.schedule import run_schedule
from core.dp.trainer import (
    METHODS,
    DPTrainConfig,
    EpochLog,
    TrainingDivergedError,
    build_reattention,
    lr_multiplier,
    method_config,
    train_seqrec,
)
from core.errors import ConfigError, DataError, PrivacyError
from core.models import SeqRecConfig, build_seqrec
from core.models.attention import attention_mask
from tests.core.data.random_sequences import random_sequences

pytestmark = [
    pytest.mark.filterwarnings("ignore:Optimal order is the:UserWarning"),  # Opacus RDP, extreme eps
    pytest.mark.usefixtures("one_thread"),
]

N_ITEMS = 20
TINY = {"d_model": 16, "max_len": 8, "batch_size": 8, "lr": 1e-2, "epochs": 1}


def cyclic_dataset(n_users: int = 32, length: int = 10, n_items: int = N_ITEMS, seed: int = 0) -> SequentialDataset:
    """User u watches items ``s, s+1, s+2, ...`` (mod M) from a random start: next item = last + 1."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(n_items, size=n_users)
    items = ((starts[:, None] + np.arange(length)) % n_items + 1).reshape(-1)
    return SequentialDataset(
        items=items,
        timestamps=np.arange(len(items)),
        offsets=np.arange(n_users + 1) * length,
        raw_user_ids=np.arange(n_users),
        raw_item_ids=np.arange(n_items),
    )


@pytest.fixture(scope="module")
def data() -> SequentialDataset:
    return cyclic_dataset()


def _finite(result: trainer.TrainResult) -> bool:
    values = [result.test_ndcg10, result.test_hit10, result.final_test_ndcg10, result.final_test_hit10]
    values += [result.test_ndcg10_masked, result.test_hit10_masked]
    values += [v for log in result.history for v in (log.valid_ndcg10, log.valid_hit10, log.train_loss)]
    values += [v for log in result.history for v in (log.valid_ndcg10_masked, log.test_ndcg10_masked)]
    return all(math.isfinite(v) for v in values)


# ---------------------------------------------------------------------------------- every method
@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_trains_privately(data: SequentialDataset, name: str) -> None:
    result = train_seqrec(data, method_config(name, **TINY, epsilon=8.0, max_steps=3))
    assert result.steps == 3 and result.ledger is not None and result.ledger.steps == 3
    assert result.ledger.epsilon <= 8.0 and result.noise_multiplier > 0
    assert result.config.clipping == METHODS[name]["clipping"]
    assert len(result.history) == 1 and _finite(result)
    assert 0 <= result.test_ndcg10 <= result.test_hit10 <= 1


@pytest.mark.parametrize(
    ("reference", "peer", "norm_first"),
    [
        ("transformer", "transformer_opacus_hooks", False),  # the methods' post-LN (App. E.2)
        ("transformer", "transformer_opacus_hooks", True),  # the pre-LN override
        ("transformer_untied", "transformer_opacus_ghost_untied", False),
    ],
)
def test_peer_clippers_train_the_same_model(
    data: SequentialDataset, reference: str, peer: str, norm_first: bool
) -> None:
    """Exact clippers + the same seeds (sampling, noise, dropout) -> the same trained parameters."""
    cfg = TINY | {"epsilon": 8.0, "max_steps": 3, "d_model": 16, "norm_first": norm_first}
    ours, theirs = (train_seqrec(data, method_config(name, **cfg)).model for name in (reference, peer))
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_methods_registry() -> None:
    assert set(METHODS) == {
        "gru", "lstm", "transformer_untied", "transformer", "dpformer",
        "transformer_opacus_hooks", "transformer_opacus_ghost_untied",
    }  # fmt: skip
    ghost = method_config("transformer_opacus_ghost_untied", epsilon=5.0, epochs=1, batch_size=8, lr=1e-3)
    assert (ghost.clipping, ghost.tied, ghost.d_model) == ("opacus_ghost", False, 32)
    dpformer = method_config("dpformer", epsilon=5.0, epochs=1, batch_size=8, lr=1e-3)
    assert dpformer.reattention and dpformer.tied and dpformer.clipping == "phantom"
    # App. E.2: Vaswani et al.'s post-LN encoder for every transformer method; RNNs keep the default
    assert {name: m.get("norm_first", True) for name, m in METHODS.items()} == {
        "gru": True, "lstm": True, "transformer_untied": False, "transformer": False, "dpformer": False,
        "transformer_opacus_hooks": False, "transformer_opacus_ghost_untied": False,
    }  # fmt: skip
    assert method_config("dpformer", epsilon=5.0, epochs=1, batch_size=8, lr=1e-3, norm_first=True).norm_first
    assert DPTrainConfig(epochs=1, batch_size=8, lr=1e-3, epsilon=5.0).norm_first  # bare config: pre-LN
    assert dpformer.normalize and dpformer.clip_norm == 1.0 and dpformer.d_model == 64
    nonprivate = method_config("gru", clipping="nonprivate", epochs=1, batch_size=8, lr=1e-3)
    assert not nonprivate.private and nonprivate.epsilon is None


# ---------------------------------------------------------------------------------------- privacy
def test_epsilon_is_spent_as_planned(data: SequentialDataset) -> None:
    """q = 8/32, 4 steps per epoch, 2 epochs: the 8 planned steps spend the target within 0.01."""
    logs: list[EpochLog] = []
    cfg = method_config("transformer", **TINY | {"epochs": 2}, epsilon=8.0)
    result = train_seqrec(data, cfg, on_epoch=logs.append)
    ledger = result.ledger
    assert result.sample_rate == 0.25 and result.steps == ledger.steps == 8
    assert ledger.delta == default_delta(32) and ledger.target_epsilon == 8.0
    assert 8.0 - 0.02 <= ledger.epsilon <= 8.0
    assert [log.step for log in logs] == [4, 8] and tuple(logs) == result.history
    assert logs[0].epsilon_spent < logs[1].epsilon_spent
    assert logs[1].epsilon_spent == pytest.approx(ledger.epsilon, rel=1e-9)  # fast path == accountant


def test_empty_poisson_batches_are_noise_only_steps(data: SequentialDataset, monkeypatch) -> None:
    def empty_batches(n, *, sample_rate, steps, generator):
        return iter([torch.empty(0, dtype=torch.long)] * steps)

    monkeypatch.setattr(trainer, "poisson_batches", empty_batches)
    result = train_seqrec(data, method_config("transformer", **TINY, epsilon=8.0, max_steps=3))
    assert result.steps == result.ledger.steps == 3
    assert math.isnan(result.history[-1].train_loss)
    torch.manual_seed(0)  # the trainer's initialisation, replayed
    initial = build_seqrec(SeqRecConfig(num_items=N_ITEMS, max_len=8, d_model=16, dropout=0.2, norm_first=False))
    moved = [not torch.equal(a, b) for a, b in zip(result.model.parameters(), initial.parameters(), strict=True)]
    assert all(moved)  # every parameter received noise


def test_same_seed_same_result_and_rng_untouched(data: SequentialDataset) -> None:
    cfg = method_config("dpformer", **TINY, epsilon=8.0, max_steps=3)
    state = torch.get_rng_state()
    first, second = train_seqrec(data, cfg), train_seqrec(data, cfg)
    assert torch.equal(state, torch.get_rng_state())
    assert first == second
    for a, b in zip(first.model.state_dict().values(), second.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    other = train_seqrec(data, method_config("dpformer", **TINY, epsilon=8.0, max_steps=3, seed=1))
    assert not torch.equal(first.model.item_emb.weight, other.model.item_emb.weight)


def test_secure_mode_is_not_reproducible_from_the_seed(data: SequentialDataset, monkeypatch) -> None:
    """secure_mode: the same config and seed train different models (noise and batches from the OS CSPRNG), the
    seeded generators are never built, and the run names its noise source; the default names the seeded one."""
    cfg = method_config("dpformer", **TINY, epsilon=8.0, max_steps=3, secure_mode=True)
    first, second = train_seqrec(data, cfg), train_seqrec(data, cfg)
    assert not torch.equal(first.model.item_emb.weight, second.model.item_emb.weight)
    assert first.ledger.epsilon == second.ledger.epsilon <= 8.0  # the same mechanism, the same accounting
    replayed = []  # every random choice beyond init and dropout goes through secrets.randbits: replaying it replays
    for _ in range(2):  # the run, so nothing else (no seeded generator) feeds the batches or the noise
        draws = iter(range(1, 10_000))
        monkeypatch.setattr(secrets, "randbits", lambda k, draws=draws: next(draws))
        replayed.append(train_seqrec(data, cfg).model.item_emb.weight)
    assert torch.equal(replayed[0], replayed[1])
    assert trainer.noise_source_of(cfg).startswith("secure")
    assert "seed kept secret" in trainer.noise_source_of(method_config("dpformer", **TINY, epsilon=8.0))
    assert trainer.noise_source_of(method_config("transformer", **TINY, clipping="nonprivate")) == "none (non-private)"


def test_reattention_changes_training_and_penalises_rare_items(data: SequentialDataset) -> None:
    vanilla = train_seqrec(data, method_config("transformer", **TINY, epsilon=8.0, max_steps=3))
    dpformer = train_seqrec(data, method_config("dpformer", **TINY, epsilon=8.0, max_steps=3))
    assert vanilla.noise_multiplier == dpformer.noise_multiplier
    assert not torch.equal(vanilla.model.item_emb.weight, dpformer.model.item_emb.weight)
    assert vanilla.correction_sizes == {} and len(dpformer.correction_sizes) == 3 * 2  # 3 sizes x 2 blocks
    # windows (N = 3): items 1 and 2 occur in 2 of them, item 3 in 1 -> item 3 has the larger variance
    inputs = torch.tensor([[1, 2, 2, 2], [2, 1, 1, 1], [3, 3, 3, 3]])
    targets = torch.tensor([[2, 2, 2, 2], [1, 1, 1, 1], [3, 3, 3, 3]])
    model = vanilla.model
    reattention = build_reattention(
        model, torch.nn.functional.pad(inputs, (4, 0)), torch.nn.functional.pad(targets, (4, 0)),
        noise_multiplier=1.0, clip_norm=1.0, expected_batch_size=2.0,
    )  # fmt: skip
    assert reattention.errors.item[3] > reattention.errors.item[1] > 0
    assert reattention.errors.item[0] == 0


@pytest.mark.parametrize("norm_first", [False, True])
def test_dpformer_trains_in_both_block_layouts(data: SequentialDataset, norm_first: bool) -> None:
    """dpformer is post-LN by default (App. E.2) and pre-LN on request; Re-Attention follows the layout,
    corrects every block, and reports each block's correction size."""
    cfg = method_config("dpformer", **TINY, epsilon=8.0, max_steps=3, norm_first=norm_first)
    result = train_seqrec(data, cfg)
    assert result.steps == 3 and _finite(result) and result.config.norm_first is norm_first
    model = result.model
    assert all(block.norm_first is norm_first for block in model.blocks)
    assert isinstance(model.final_norm, torch.nn.LayerNorm if norm_first else torch.nn.Identity)
    inputs, targets = data.train_examples(8)
    reattention = build_reattention(
        model, inputs, targets, noise_multiplier=result.noise_multiplier, clip_norm=1.0,
        expected_batch_size=8.0,
    )  # fmt: skip
    errors = reattention.propagate(inputs)
    assert len(errors) == model.cfg.n_layers == 2
    counted = attention_mask(inputs != 0) & (inputs != 0)[:, None, :, None]  # real query, real earlier key
    for block in errors:
        assert bool((block.penalty[counted.expand_as(block.penalty)] > 0).all())
    sizes = result.correction_sizes
    names = ("correction_median", "correction_max", "attention_tv")
    assert set(sizes) == {f"reattention.block{k}.{name}" for k in (1, 2) for name in names}
    assert all(math.isfinite(v) and v >= 0 for v in sizes.values())
    assert sizes["reattention.block1.correction_max"] >= sizes["reattention.block1.correction_median"]


# --------------------------------------------------------------------------------------- learning
def test_nonprivate_learns_the_next_item_pattern() -> None:
    """Next item = last + 1: a random ranking of 20 items has NDCG@10 ~0.23; training reaches > 0.6."""
    data = cyclic_dataset(n_users=48)
    cfg = method_config("transformer", **TINY | {"epochs": 8, "batch_size": 16}, clipping="nonprivate", dropout=0.0)
    result = train_seqrec(data, cfg)
    losses = [log.train_loss for log in result.history]
    assert result.ledger is None and result.noise_multiplier == 0 and math.isinf(result.history[0].epsilon_spent)
    assert result.steps == 8 * 3 and len(result.history) == 8
    assert losses[-1] < 0.6 * losses[0]
    assert result.test_ndcg10 > 0.6 and result.test_hit10 >= result.test_ndcg10


def test_large_epsilon_beats_tiny_epsilon() -> None:
    data = cyclic_dataset(n_users=48)
    base = TINY | {"epochs": 8, "batch_size": 16, "dropout": 0.0}
    loose = train_seqrec(data, method_config("transformer", **base, epsilon=1e3))
    tight = train_seqrec(data, method_config("transformer", **base, epsilon=0.05))
    assert loose.noise_multiplier < 0.5 and tight.noise_multiplier > 20
    # random ranking ~0.23; the post-LN default reaches ~0.55 in these 24 steps (pre-LN ~0.63)
    assert loose.test_ndcg10 > 0.5 > tight.test_ndcg10 + 0.2


def test_eval_every_and_partial_last_epoch(data: SequentialDataset) -> None:
    cfg = method_config("gru", **TINY | {"epochs": 3}, eval_every=2, clipping="nonprivate", max_steps=10)
    result = train_seqrec(data, cfg)  # 4 steps per epoch, the last epoch cut at step 10
    assert [(log.epoch, log.step) for log in result.history] == [(2, 8), (3, 10)]
    assert result.best_epoch in (2, 3) and result.steps == 10


def test_lr_schedule_warms_up_then_decays_linearly() -> None:
    factors = [lr_multiplier(s, total_steps=10, warmup_steps=2) for s in range(10)]
    assert factors[:3] == [0.5, 1.0, 1.0]
    assert factors[2:] == pytest.approx([(10 - s) / 8 for s in range(2, 10)])
    assert lr_multiplier(0, total_steps=1, warmup_steps=0) == 1.0


# ----------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"epsilon": 0.0}, "epsilon must be a finite number > 0"),
        ({"epsilon": -1.0}, "epsilon=-1.0"),
        ({"epsilon": math.nan}, "epsilon"),
        ({"epsilon": None}, "epsilon must be"),
        ({"epsilon": 8.0, "delta": 0.0}, "delta must be in"),
        ({"epsilon": 8.0, "delta": 1.5}, "delta=1.5"),
        ({"clipping": "nonprivate", "epsilon": 8.0}, "epsilon and delta must be None"),
        ({"clipping": "bogus", "epsilon": 8.0}, "unknown clipping='bogus'"),
        ({"clipping": "opacus_ghost", "epsilon": 8.0}, "tied"),
        ({"arch": "gru", "reattention": True, "epsilon": 8.0}, "reattention=True needs attention"),
        (
            {"arch": "lstm", "norm_first": False, "epsilon": 8.0},
            "norm_first=False .* needs arch='transformer'",
        ),
        ({"norm_first": 1, "epsilon": 8.0}, "norm_first must be a bool"),
        ({"secure_mode": "yes", "epsilon": 8.0}, "secure_mode must be a bool"),
        ({"clipping": "nonprivate", "secure_mode": True}, "secure_mode=True secures the DP noise"),
        ({"epsilon": 8.0, "lr": 0.0}, "lr must be"),
        ({"epsilon": 8.0, "batch_size": 0}, "batch_size must be a positive integer"),
        ({"epsilon": 8.0, "warmup_frac": 1.0}, "warmup_frac"),
        ({"epsilon": 8.0, "d_model": 10, "n_heads": 3}, "divisible"),
        ({"epsilon": 8.0, "accountant": "moments"}, "unknown accountant"),
        ({"epsilon": 8.0, "max_steps": 0}, "max_steps"),
    ],
)
def test_bad_config_is_rejected(overrides: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        DPTrainConfig(**{"epochs": 1, "batch_size": 8, "lr": 1e-3} | overrides)


def test_method_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown method 'sasrec'; known methods: gru, lstm"):
        method_config("sasrec", epochs=1, batch_size=8, lr=1e-3)
    with pytest.raises(ConfigError, match="unknown DPTrainConfig field"):
        method_config("gru", epochs=1, batch_size=8, lr=1e-3, epsilon=1.0, learning_rate=1.0)
    with pytest.raises(ConfigError, match="epochs"):
        method_config("gru", batch_size=8, lr=1e-3, epsilon=1.0)


def test_data_dependent_errors(data: SequentialDataset) -> None:
    with pytest.raises(ConfigError, match=r"delta=0.05 >= 1/N = 0.03125 for N=32"):
        train_seqrec(data, method_config("transformer", **TINY, epsilon=8.0, delta=0.05))
    with pytest.raises(ConfigError, match="batch larger than the dataset"):
        train_seqrec(data, method_config("transformer", **TINY | {"batch_size": 33}, epsilon=8.0))
    held_out_only = cyclic_dataset(n_users=4, length=3)
    with pytest.raises(DataError, match="no training targets"):
        train_seqrec(held_out_only, method_config("transformer", **TINY, epsilon=8.0))
    with pytest.raises(DataError, match="SequentialDataset"):
        train_seqrec(None, method_config("transformer", **TINY, epsilon=8.0))  # type: ignore[arg-type]


@pytest.mark.parametrize("clipping", ["phantom", "nonprivate"])
def test_nan_loss_stops_training_naming_the_step(data: SequentialDataset, monkeypatch, clipping: str) -> None:
    calls = {"n": 0}
    real_loss = trainer.sequence_loss

    def nan_on_second_call(*args, **kwargs):
        calls["n"] += 1
        loss = real_loss(*args, **kwargs)
        return loss * math.nan if calls["n"] == 2 else loss

    monkeypatch.setattr(trainer, "sequence_loss", nan_on_second_call)
    epsilon = None if clipping == "nonprivate" else 8.0
    cfg = method_config("transformer", **TINY, clipping=clipping, epsilon=epsilon, max_steps=3)
    with pytest.raises(TrainingDivergedError, match="loss is nan at step 2 .*lower the learning rate") as info:
        train_seqrec(data, cfg)
    assert isinstance(info.value, PrivacyError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("norm_first", [False, True])
def test_reattention_corrects_every_block_in_both_layouts(
    data: SequentialDataset, norm_first: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The effective errors are propagated block by block (core.dp.propagation): every block, pre- and
    post-LN, gets its own correction, in training and in evaluation."""
    from core.models.attention import CausalSelfAttention

    seen: list[bool] = []
    original = CausalSelfAttention.forward

    def spy(self, x, key_valid, score_correction=None, window=None):
        seen.append(score_correction is not None)
        return original(self, x, key_valid, score_correction, window)

    monkeypatch.setattr(CausalSelfAttention, "forward", spy)
    cfg = method_config("dpformer", **TINY, epsilon=8.0, max_steps=1, n_layers=2, norm_first=norm_first)
    train_seqrec(data, cfg)
    per_forward = [seen[i : i + 2] for i in range(0, len(seen), 2)]
    assert per_forward and all(p == [True, True] for p in per_forward)


# ------------------------------------------------------------------------- every target, user-level
def _ragged_dataset(seed: int = 0) -> SequentialDataset:
    """Users of 4 to 30 items, so that max_len 5 gives them 1 to 6 windows."""
    return random_sequences(24, N_ITEMS, min_len=4, max_len=30, seed=seed)


@pytest.mark.parametrize("name", ["transformer", "dpformer", "gru"])
def test_chunked_every_target_step_is_the_users_clipped_sum(name: str) -> None:
    """Slow reference: per user, the gradient of its summed loss over all of its windows, clipped once, summed."""
    from core.dp.clipping import clip_coefficients
    from core.models import sequence_loss

    data = _ragged_dataset()
    cfg = method_config(name, **(TINY | {"max_len": 5, "epsilon": 8.0, "dropout": 0.0, "clip_norm": 0.5}))
    assert cfg.train_targets == "every"
    run = trainer._Run(data, cfg, run_schedule(data, cfg), torch.device("cpu"))
    users = torch.arange(data.n_users)
    chunks = list(run.chunks(users))
    assert len(chunks) > 1 and sorted(torch.cat(chunks).tolist()) == users.tolist()
    run.optimizer.zero_grad(set_to_none=True)
    for chunk in chunks:
        run.clipper.backward(run._per_sequence_loss(chunk))
    got = {n: p.grad.clone() for n, p in run.model.named_parameters()}
    expected = {n: torch.zeros_like(p) for n, p in run.model.named_parameters()}
    params = dict(run.model.named_parameters())
    for u in range(data.n_users):
        ids, targets = data.train_windows(5, [u])
        correction = run._correction(ids)
        logits = run.model(ids) if correction is None else run.model(ids, score_correction=correction)
        grads = torch.autograd.grad(sequence_loss(logits, targets).sum(), list(params.values()), allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params.values(), grads)]
        coef = clip_coefficients(torch.sqrt(sum(g.pow(2).sum() for g in grads)), clip_norm=0.5, normalize=True)
        for n, g in zip(params, grads):
            expected[n] += coef * g
    for n, value in got.items():
        torch.testing.assert_close(value, expected[n], rtol=1e-4, atol=1e-6, msg=n)


def test_every_target_trains_on_every_pair_and_last_window_on_fewer() -> None:
    data = _ragged_dataset()
    pairs = int((data.seq_lens - 3).sum())
    for targets, expected in (("every", pairs), ("last_window", int(np.minimum(data.seq_lens - 3, 5).sum()))):
        cfg = method_config("transformer", **(TINY | {"max_len": 5, "epsilon": 8.0, "train_targets": targets}))
        run = trainer._Run(data, cfg, run_schedule(data, cfg), torch.device("cpu"))
        for chunk in run.chunks(torch.arange(data.n_users)):
            run._per_sequence_loss(chunk)
        assert run.loss_tokens == expected
    result = train_seqrec(data, method_config("dpformer", **(TINY | {"max_len": 5, "epsilon": 8.0})))
    assert _finite(result) and result.ledger.epsilon <= 8.0 + 1e-6


def test_patience_stops_once_validation_stops_improving(data: SequentialDataset) -> None:
    """lr so small the model cannot move: validation is flat after the first evaluation, so patience 2 stops after
    the third; without patience every epoch runs. The best epoch is still the first maximum on validation."""
    cfg = TINY | {"clipping": "nonprivate", "epochs": 6, "lr": 1e-12}
    full = train_seqrec(data, method_config("transformer", **cfg))
    early = train_seqrec(data, method_config("transformer", **cfg, patience=2))
    assert [log.epoch for log in full.history] == [1, 2, 3, 4, 5, 6]
    assert [log.epoch for log in early.history] == [1, 2, 3] and early.steps < full.steps
    assert early.best_epoch == full.best_epoch == 1
    patient = train_seqrec(data, method_config("transformer", **cfg, patience=6))  # more than the epochs left
    assert len(patient.history) == 6 and patient.steps == full.steps
    with pytest.raises(ConfigError, match="patience must be a positive integer"):
        method_config("transformer", **cfg, patience=0)


def test_only_the_untied_opacus_peer_runs_at_half_width() -> None:
    """DPFormer footnote 5: the peer that cannot tie its embeddings halves d_model, so its two tables hold about as
    many parameters as one shared table; every other method runs at the comparison's width."""
    from core.dp.methods import method_d_model

    widths = {name: method_d_model(name, 64) for name in METHODS}
    assert widths.pop("transformer_opacus_ghost_untied") == 32 and set(widths.values()) == {64}
    with pytest.raises(ConfigError, match="unknown method 'sasrec'"):
        method_d_model("sasrec", 64)
    with pytest.raises(ConfigError, match="d_model must be a positive int, got 0"):
        method_d_model("transformer", 0)
