"""The attack stage's config: the profiles load, bad values are refused with messages naming them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.attacks import vocab
from pbconfig.attacks import LM_VOCABS, AttacksConfig, FilmConfig, UtilityConfig
from pbconfig.benchmark import load_config


@pytest.mark.parametrize("profile", ["quick", "paper"])
def test_profiles_configure_the_attack_stage(profile: str) -> None:
    cfg = load_config(profile)
    assert cfg.attacks is not None and cfg.attacks.film is not None and cfg.attacks.utility is not None
    prepared = {t.name for t in cfg.prepare.texts}
    assert set(cfg.attacks.text_datasets()) <= prepared
    assert cfg.attacks.seb.n_bytes == 8 and cfg.attacks.seb.byte_vocab == 256  # the paper's defaults (Sec. 5)
    assert set(cfg.attacks.film.batch_sizes) == {1, 2, 4, 8}


def test_bad_values_are_named() -> None:
    with pytest.raises(ValidationError, match="batch_sizes must be distinct positive"):
        FilmConfig(batch_sizes=(1, 1))
    with pytest.raises(ValidationError, match="min_tokens=30 exceeds max_tokens=20"):
        FilmConfig(min_tokens=30, max_tokens=20)
    with pytest.raises(ValidationError, match="lacks 'subword'"):
        UtilityConfig(embeddings=("seb_co",))
    with pytest.raises(ValidationError, match="nothing to do"):
        AttacksConfig()
    with pytest.raises(ValidationError, match="must be a multiple of n_head=3"):
        FilmConfig(shape={"n_embd": 10, "n_head": 3})


def test_prior_from_a_path_needs_no_public_text() -> None:
    cfg = AttacksConfig(film={"private": ["a"], "prior": {"public": ["b"], "path": "/models/gpt2"}})
    assert cfg.text_datasets() == ["a"]


def test_audit_config_refuses_too_few_shadows_and_missing_training_section() -> None:
    from core.errors import ConfigError
    from pbconfig.attacks import AuditConfig
    from pbconfig.benchmark import BenchmarkConfig, validate

    with pytest.raises(ValidationError, match="shadows=2 is too few"):
        AuditConfig(shadows=2)
    assert AuditConfig(shadows=2, attacks=("loss", "lira_offline")).shadows == 2  # offline needs no IN shadows
    quick = load_config("quick").model_dump(mode="json")
    no_train = {k: v for k, v in quick.items() if k != "train_dp"}
    with pytest.raises(ConfigError, match="train_dp section"):
        validate(BenchmarkConfig, no_train, origin="test")
    quick["attacks"]["audit"]["datasets"] = ["amazon-games-synthetic"]
    with pytest.raises(ConfigError, match="not in train_dp.datasets"):
        validate(BenchmarkConfig, quick, origin="test")


def test_utility_seeds_are_validated() -> None:
    assert UtilityConfig().run_seeds == (0,) and UtilityConfig(seed=4).run_seeds == (4,)
    assert UtilityConfig(seeds=(0, 1, 2)).run_seeds == (0, 1, 2)
    for bad in ((), (0, 0), (1, -1)):
        with pytest.raises(ValidationError, match="utility.seeds must be distinct integers >= 0"):
            UtilityConfig(seeds=bad)


def test_utility_lm_vocab_is_compact_or_full_and_a_bad_one_is_named() -> None:
    assert UtilityConfig().lm_vocab == "compact" and UtilityConfig(lm_vocab="full").lm_vocab == "full"
    assert LM_VOCABS == vocab.LM_VOCABS  # the settings the task's core.attacks.vocab.lm_vocabulary builds
    for bad in ("whole", "FULL", None):
        with pytest.raises(ValidationError, match=rf"utility.lm_vocab={bad!r} is not a vocabulary setting.*'full'"):
            UtilityConfig(lm_vocab=bad)
    # the profiles: quick trains the compact vocabulary, paper the paper's whole one (Table 6)
    assert load_config("quick").attacks.utility.lm_vocab == "compact"
    assert load_config("paper").attacks.utility.lm_vocab == "full"


def test_priors_are_named_and_share_the_victims_vocabulary() -> None:
    one = FilmConfig(prior={"name": "kjv", "steps": 5})
    assert [p.name for p in one.priors] == ["kjv"] and one.prior.steps == 5  # `prior:` reads as `priors: [prior]`
    both = FilmConfig(vocab="smollm2", priors=[{"name": "smollm2", "kind": "smollm2"}, {"name": "kjv"}])
    assert [p.kind for p in both.priors] == ["smollm2", "trained"]
    assert AttacksConfig(film=both.model_dump()).text_datasets() == ["shakespeare", "kjv"]
    with pytest.raises(ValidationError, match="set film.vocab: smollm2"):
        FilmConfig(priors=[{"name": "smollm2", "kind": "smollm2"}])
    with pytest.raises(ValidationError, match="distinct names"):
        FilmConfig(priors=[{"name": "a"}, {"name": "a"}])
    with pytest.raises(ValidationError, match="not both"):
        FilmConfig(prior={}, priors=[{}])


def test_batches_per_size_is_one_count_or_one_per_batch_size() -> None:
    assert FilmConfig(batch_sizes=(1, 2), batches_per_size=3).batches_for(2) == 3
    per = FilmConfig(batch_sizes=(1, 2), batches_per_size={1: 5, 2: 1})
    assert (per.batches_for(1), per.batches_for(2)) == (5, 1)
    with pytest.raises(ValidationError, match=r"names batch sizes \[1\] but film.batch_sizes is \[1, 2\]"):
        FilmConfig(batch_sizes=(1, 2), batches_per_size={1: 5})
    with pytest.raises(ValidationError, match="must be >= 1 for every batch size"):
        FilmConfig(batch_sizes=(1,), batches_per_size={1: 0})
