"""Configuration of the attack stage (``privbench run attacks``).

Part 1 (SEB paper, ``../shared/papers/seb-subword-embedding-from-bytes.txt``): the FILM-style text recovery from
embedding gradients in FedSGD against subword embeddings and against SEB (``film``), and the utility side of
the defence: language-model perplexity and German->English translation BLEU (``utility``).
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field, field_validator, model_validator

from pbconfig.base import Delta, Epsilon, FrozenConfig, ModelShape, SeedPasses
from pbconfig.train_dp import TrainMethod

Embedding = Literal["subword", "seb_ar", "seb_cr", "seb_co"]
EMBEDDINGS: tuple[str, ...] = get_args(Embedding)
SebEmbedding = Literal["seb_ar", "seb_cr", "seb_co"]
# what the attacker does with the gradient (see core.attacks.film):
#   subwords    non-zero rows of a subword embedding's gradient (subword victims only)
#   bytes       non-zero byte rows, then every subword made only of those bytes (the SEB attacker)
#   positional  non-zero (position, byte) rows of SEB_co's first layer, every subword matching at each position
#   relaxed     the paper's relaxed setting (Sec. 5.1): `relaxed_random` random subwords plus the true ones
FilmSetting = Literal["subwords", "bytes", "positional", "relaxed"]
FILM_SETTINGS: tuple[str, ...] = get_args(FilmSetting)
# the victims' tokenizer: GPT-2's BPE (50,257 subwords) or SmolLM2's (49,152), shared with the attacker's prior
FilmVocab = Literal["gpt2", "smollm2"]
# the prior: a small causal LM trained on public text (or the model folder `path`), or the pretrained SmolLM2-135M
PriorKind = Literal["trained", "smollm2"]
# the vocabulary the utility LMs train at: the training text's subwords plus <unk>, or GPT-2's whole 50,257
LmVocab = Literal["compact", "full"]
LM_VOCABS: tuple[str, ...] = get_args(LmVocab)


class SEBSpec(FrozenConfig):
    """Subword Embedding from Bytes (Sec. 4): ``n_bytes`` bytes per subword from a byte vocabulary of
    ``byte_vocab`` (paper defaults 256 and 8, Sec. 5), a 2-layer FFN of ``hidden`` units; ``byte_dim`` is the
    real-valued byte embedding size of SEB_ar/SEB_cr. The mapping is drawn with ``seed`` and saved with the model."""

    n_bytes: int = Field(8, ge=1)
    byte_vocab: int = Field(256, ge=2)
    byte_dim: int = Field(64, ge=1)
    hidden: int = Field(512, ge=1)
    seed: int = Field(0, ge=0)


class ModelShapeSpec(ModelShape):
    """A small GPT-2-shaped causal LM (defaults: 2 layers, width 128, 4 heads)."""

    n_layer: int = Field(2, ge=1)
    n_embd: int = Field(128, ge=8)
    n_head: int = Field(4, ge=1)


class PriorSpec(FrozenConfig):
    """One attacker's language-model prior (FILM steps 2-3), named ``name`` in the results. ``kind="trained"``:
    a small causal LM in the victims' vocabulary trained on the ``public`` text datasets (disjoint from the
    clients' private text), or the Hugging Face model folder ``path`` (e.g. real GPT-2 weights, when a user has
    them: its vocabulary must be the victims'); ``kind="smollm2"``: the pretrained SmolLM2-135M shipped offline
    (victims with ``vocab: smollm2``; the training fields are ignored)."""

    name: str = Field("kjv-small", min_length=1, pattern=r"^[A-Za-z0-9_-]+$")
    kind: PriorKind = "trained"
    public: tuple[str, ...] = Field(("kjv",), description="prepared text datasets the prior is trained on")
    path: str | None = None
    shape: ModelShapeSpec = ModelShapeSpec()
    max_len: int = Field(64, ge=8)
    steps: int = Field(400, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(3e-3, gt=0.0)
    max_seconds: float | None = Field(None, gt=0.0, description="stop training after this long (None: all steps)")


class FilmConfig(FrozenConfig):
    """FILM against subword and SEB victims in FedSGD (Sec. 3.2-3.3, 5.1).

    ``n_clients`` clients each hold a disjoint share of the ``private`` text datasets; the victim model is
    trained for ``warmup_rounds`` FedSGD rounds, then in the attacked round the server (the attacker) reads one
    client's gradient for each of ``batches_per_size`` batches of every size in ``batch_sizes``, and recovers
    text with each prior of ``priors`` (a single ``prior:`` is read as ``priors: [prior]``).

    ``vocab="gpt2"``: GPT-2-shaped victims of ``shape``; ``vocab="smollm2"``: SmolLM2-architecture victims, the
    pretrained SmolLM2-135M cut to its first ``shape.n_layer`` blocks (width and heads are SmolLM2's), with its
    subword embedding or SEB in its place (``core.attacks.llama_victim``).
    """

    private: tuple[str, ...] = Field(("shakespeare",), min_length=1)
    vocab: FilmVocab = "gpt2"
    victims: tuple[Embedding, ...] = ("subword", "seb_co")
    settings: tuple[FilmSetting, ...] = FILM_SETTINGS
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    batches_per_size: int | dict[int, int] = Field(
        5, description="attacked batches per batch size: one count for every size, or {size: count} (paper: 5)"
    )
    relaxed_random: int = Field(7000, ge=0, description="random subwords added in the relaxed setting (paper: 7,000)")
    shape: ModelShapeSpec = ModelShapeSpec()
    max_tokens: int = Field(40, ge=4, description="longest private sentence, in GPT-2 tokens")
    min_tokens: int = Field(16, ge=1)
    n_clients: int = Field(4, ge=1)
    warmup_rounds: int = Field(3, ge=0)
    client_batch_size: int = Field(8, ge=1, description="batch size of the warm-up rounds")
    fed_lr: float = Field(0.01, gt=0.0)
    beam_width: int = Field(8, ge=1)
    reorder_passes: int = Field(2, ge=0)
    reorder_moves: int | None = Field(256, ge=1, description="orderings scored per reordering pass (None: all)")
    repeat_penalty: float = Field(20.0, ge=0.0, description="beam-search penalty (nats) per reuse of a subword")
    priors: tuple[PriorSpec, ...] = Field((PriorSpec(),), min_length=1)
    seed: int = Field(0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _one_prior(cls, data: Any) -> Any:
        if isinstance(data, dict) and "prior" in data:
            if "priors" in data:
                raise ValueError("give film.prior or film.priors, not both")
            data = {**data, "priors": [data["prior"]]}
            del data["prior"]
        return data

    @field_validator("batch_sizes")
    @classmethod
    def _sizes(cls, values: tuple[int, ...]) -> tuple[int, ...]:
        if not values or any(v < 1 for v in values) or len(set(values)) != len(values):
            raise ValueError(f"batch_sizes must be distinct positive integers, got {list(values)}; e.g. [1, 2, 4, 8]")
        return values

    def batches_for(self, batch_size: int) -> int:
        """How many batches of ``batch_size`` sentences are attacked."""
        per = self.batches_per_size
        return per if isinstance(per, int) else per[batch_size]

    @model_validator(mode="after")
    def _consistent(self) -> FilmConfig:
        per = self.batches_per_size
        counts = [per] if isinstance(per, int) else list(per.values())
        if any(c < 1 for c in counts):
            raise ValueError(f"film.batches_per_size must be >= 1 for every batch size, got {per}")
        if isinstance(per, dict) and set(per) != set(self.batch_sizes):
            raise ValueError(
                f"film.batches_per_size names batch sizes {sorted(per)} but film.batch_sizes is "
                f"{list(self.batch_sizes)}; give a count for every batch size (or one count for all)"
            )
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}")
        if not self.victims:
            raise ValueError("film.victims is empty; pick from " + ", ".join(EMBEDDINGS))
        if len(set(self.victims)) != len(self.victims):
            raise ValueError(f"film.victims must be distinct, got {list(self.victims)}")
        names = [p.name for p in self.priors]
        if len(set(names)) != len(names):
            raise ValueError(f"film.priors need distinct names, got {names}")
        for p in self.priors:
            if p.kind == "smollm2" and self.vocab != "smollm2":
                raise ValueError(
                    f"prior {p.name!r} is SmolLM2 (49,152 subwords) but film.vocab={self.vocab!r}; the prior must "
                    "share the victims' tokenizer: set film.vocab: smollm2"
                )
        return self

    @property
    def prior(self) -> PriorSpec:
        """The first prior."""
        return self.priors[0]


class UtilityConfig(FrozenConfig):
    """The utility side of the defence (Sec. 5.2): the same small models, the same training budget, with
    subword embeddings or SEB. ``lm_datasets``: perplexity of a causal LM on each prepared text dataset;
    ``translation``: German->English BLEU on a prepared ``gettext-de-en`` dataset (None: skip).

    ``lm_vocab`` is the vocabulary every LM trains at. ``compact``: the subwords of the training text plus
    ``<unk>``; the subword table shrinks with the corpus (~8.7k rows on Shakespeare) and SEB's parameters do not, so
    SEB_co has more embedding parameters than the subword arm. ``full``: GPT-2's whole vocabulary (50,257 rows and
    logits), the paper's Table 6 relation (SEB_co fewer). Both arms tie the output layer to the input embedding, so
    the recorded ``embedding_params`` is the input module's, counted once. Perplexities of the two settings differ
    in kind (compact folds every unseen test subword into one ``<unk>`` class) and are compared within a setting.

    ``matched``: SEB variants trained a second time at the subword arm's embedding parameters (technique
    ``seb-lm-<variant>-matched``): the FFN's hidden width is the widest whose module has no more parameters than the
    subword table at the same vocabulary and width (``core.attacks.seb.matched_hidden``), everything else as the
    variant's own arm. It compares utility at equal size where the vocabulary makes ``seb.hidden`` the larger.
    """

    embeddings: tuple[Embedding, ...] = EMBEDDINGS
    matched: tuple[SebEmbedding, ...] = Field(
        (),
        description="SEB variants also trained with their FFN narrowed to the subword table's parameter count",
    )
    lm_datasets: tuple[str, ...] = ("shakespeare", "kjv")
    lm_vocab: LmVocab = Field(
        "compact", description="the LMs' vocabulary: compact (the training text's subwords) or full (GPT-2's 50,257)"
    )
    lm_shape: ModelShapeSpec = ModelShapeSpec()
    lm_max_len: int = Field(64, ge=8)
    lm_steps: int = Field(300, ge=1)
    lm_batch_size: int = Field(32, ge=1)
    lm_lr: float = Field(3e-3, gt=0.0)
    lm_eval_every: int | None = Field(
        None,
        ge=1,
        description="train each LM to a plateau: validation perplexity every this many steps (None: all lm_steps)",
    )
    lm_patience: int | None = Field(
        None,
        ge=1,
        description=(
            "validation measurements without improvement that end training (None: no early stopping; every LM "
            "trains all lm_steps, kept at its best validation measurement where lm_eval_every is set: Fairseq's "
            "checkpoint_best)"
        ),
    )
    lm_val_fraction: float = Field(
        0.1, gt=0.0, lt=0.5, description="training sentences held out for validation when lm_eval_every is set"
    )
    translation: str | None = "gettext-de-en"
    translation_embeddings: tuple[Embedding, ...] | None = Field(
        None, description="embeddings compared on translation (None: the same as embeddings)"
    )
    mt_d_model: int = Field(128, ge=8)
    mt_layers: int = Field(2, ge=1)
    mt_heads: int = Field(4, ge=1)
    mt_ff: int = Field(256, ge=8)
    mt_max_len: int = Field(48, ge=8)
    mt_steps: int = Field(600, ge=1)
    mt_batch_size: int = Field(32, ge=1)
    mt_lr: float = Field(1e-3, gt=0.0)
    mt_eval: int = Field(300, ge=1, description="test pairs translated for BLEU")
    max_seconds: float | None = Field(None, gt=0.0, description="cap on each model's training time (None: all steps)")
    seed: int = Field(0, ge=0)
    seeds: tuple[int, ...] | None = Field(
        None, description="one run per seed for every model (intervals over seeds in the claims); None: (seed,)"
    )

    @field_validator("lm_vocab", mode="before")
    @classmethod
    def _lm_vocab(cls, value: Any) -> Any:
        if value not in LM_VOCABS:
            raise ValueError(
                f"utility.lm_vocab={value!r} is not a vocabulary setting; use 'compact' (the training text's subwords "
                "plus <unk>) or 'full' (GPT-2's whole 50,257-subword vocabulary, as the paper's Table 6 counts)"
            )
        return value

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, values: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if values is None:
            return values
        if not values or any(v < 0 for v in values) or len(set(values)) != len(values):
            raise ValueError(f"utility.seeds must be distinct integers >= 0 and not empty, got {list(values)}")
        return values

    @property
    def run_seeds(self) -> tuple[int, ...]:
        """The seeds every utility model is trained with."""
        return self.seeds if self.seeds is not None else (self.seed,)

    @model_validator(mode="after")
    def _some_work(self) -> UtilityConfig:
        if not self.embeddings:
            raise ValueError("utility.embeddings is empty; pick from " + ", ".join(EMBEDDINGS))
        if "subword" not in self.embeddings:
            raise ValueError(
                f"utility.embeddings={list(self.embeddings)} lacks 'subword', the baseline SEB is compared with; add it"
            )
        if len(set(self.matched)) != len(self.matched):
            raise ValueError(f"utility.matched={list(self.matched)} names a variant twice; list each once")
        return self

    @property
    def mt_embeddings(self) -> tuple[str, ...]:
        return self.translation_embeddings if self.translation_embeddings is not None else self.embeddings


MiaAttack = Literal["loss", "lira_online", "lira_offline"]
MIA_ATTACKS: tuple[str, ...] = get_args(MiaAttack)


class AuditConfig(SeedPasses):
    """Part 2: membership-inference audit of the private-training stage's sequential recommenders and of the
    tangent stage's unlearning.

    For every dataset x (method x epsilon [+ non-private]) the audit trains a target on a random half of the
    users and ``shadows`` shadow models on random halves (every user in exactly half of them), with the same
    training code at the recipe of the ``train_dp`` section's runs (the searched (lr, batch size) where
    ``train_dp.tuning`` is set; the non-private model trains at the same recipe, less the DP step; ``epochs`` overrides
    the epoch count), then
    runs each attack of ``attacks`` (loss threshold; LiRA online and offline, Carlini et al. 2022). The member
    unit is a user's sequence, as in user-level DP. ``delta`` for the empirical epsilon: None = the target's
    accountant delta (non-private targets: the delta of their DP twins, 1/(10 N) for their N member users unless
    ``train_dp.delta`` sets one). ``alpha``: 1 - confidence of the Clopper-Pearson bounds.
    ``seeds`` audits every target once per seed (each seed its own target and shadow models, and its own halves of
    the users), so a comparison of audited models gets an interval over trainings, not only over users; the
    TAFT forgetting audit runs at ``seed``.
    """

    datasets: tuple[str, ...] = Field(("ml-100k",), min_length=1)
    methods: tuple[TrainMethod, ...] = ("transformer", "dpformer")
    epsilons: tuple[Epsilon, ...] = (8.0,)
    nonprivate: bool = True
    shadows: int = Field(4, ge=1)
    attacks: tuple[MiaAttack, ...] = MIA_ATTACKS
    epochs: int | None = Field(None, ge=1, description="None: train_dp.epochs")
    delta: Delta | None = None
    alpha: float = Field(0.05, gt=0.0, lt=1.0)
    unlearning: bool = Field(
        True,
        description="also audit the tangent stage's composed TAFT model before and "
        "after forgetting half of its shards (needs the tangent section)",
    )
    unlearning_epochs: int | None = Field(
        None, ge=1, description="epochs of the audited TAFT shards (None: tangent.epochs)"
    )

    @model_validator(mode="after")
    def _enough_shadows(self) -> AuditConfig:
        if "lira_online" in self.attacks and self.shadows < 4:
            raise ValueError(
                f"online LiRA needs every user inside and outside shadow models and a pooled variance: "
                f"shadows={self.shadows} is too few; use shadows >= 4 (the paper uses 16+) or drop "
                "'lira_online' from attacks"
            )
        return self


class AttacksConfig(FrozenConfig):
    """Stage 5: attack evaluation. Part 1: FILM vs subword/SEB and SEB's utility; part 2: the membership
    audit of the private-training stage's models."""

    seb: SEBSpec = SEBSpec()
    film: FilmConfig | None = None
    utility: UtilityConfig | None = None
    audit: AuditConfig | None = None
    workers: int = Field(2, ge=1, description="runs executed in parallel (processes)")
    threads_per_worker: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _some_part(self) -> AttacksConfig:
        if self.film is None and self.utility is None and self.audit is None:
            raise ValueError("attacks has nothing to do: give film, utility and/or audit")
        return self

    def text_datasets(self) -> list[str]:
        """Every prepared text dataset this stage reads."""
        names: list[str] = []
        if self.film is not None:
            names += [*self.film.private]
            for p in self.film.priors:
                names += [*p.public] if p.kind == "trained" and p.path is None else []
        if self.utility is not None:
            names += [*self.utility.lm_datasets, *([self.utility.translation] if self.utility.translation else [])]
        return list(dict.fromkeys(names))
