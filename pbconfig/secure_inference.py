"""Stage 4 (secure-inference): two-party encrypted GPT-2 generation (the ``secure_inference`` section)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, model_validator

from pbconfig.base import FrozenConfig, ModelShape, SeedPasses, require_heads_divide

SIMethod = Literal[
    "vanilla", "vanilla_kv", "mpcformer_2relu", "mpcformer_2quad", "thex", "merge_er", "merge_mm", "merge"
]
SI_METHODS: tuple[str, ...] = get_args(SIMethod)
PretrainCorpus = Literal["shakespeare", "milton", "kjv", "chatterbot"]
SIBase = Literal["gpt2", "smollm2"]


class NetworkSpec(FrozenConfig):
    """A link the measured runs are projected onto (``core.mpc.costmodel``)."""

    bandwidth_gbps: float = Field(gt=0.0)
    rtt_ms: float = Field(ge=0.0)


class SecureInferenceConfig(SeedPasses):
    """Stage 4: two-party encrypted GPT-2 generation with CrypTen (MERGE vs vanilla MPC, MPCFormer, THE-X).

    A GPT-2 with the real 50,257-token BPE vocabulary and the shape below is trained on the offline dialogue
    corpus (``train_steps``), the MPCFormer/THE-X students are distilled from it (``distill_steps``), MERGE's
    ER model is trained from it (eq. 7, ``er_steps``) and its merge modules distilled (``mm_steps``); then every
    method generates ``gen_len`` tokens after ``prefix_len`` prompt tokens for ``n_prompts`` test prompts under
    two-party MPC, with per-operation costs and the quality of the decrypted text. ``seeds`` (None: the one
    ``seed``) runs the whole stage once per seed, so that its comparisons get intervals over seeds.

    With ``pretrain_steps`` > 0 that GPT-2 is first pretrained on the offline English text of
    ``pretrain_corpora`` (a content-addressed model, trained once per config and text), then fine-tuned;
    ``pretrain_seed`` set makes that pretrained GPT-2 one model shared by every seed pass (the passes' seeds
    then drive the fine-tuning, distillation, prompts and shares, as fine-tuning one public checkpoint does).

    ``base: smollm2`` runs the stage on the real pretrained SmolLM2-135M (LLaMA architecture, its own 49,152-token
    tokenizer) instead: it is fine-tuned on the dialogue corpus from its released weights (no pretraining here,
    ``pretrain_steps`` 0), and the ER model and merge modules are trained from it as for GPT-2; ``n_layer``,
    ``n_embd`` and ``n_head`` are the model's own and not read. Its MPCFormer / THE-X students are distilled on its
    LLaMA modules (``core.mpc.approx_llama``); the length-scaling runs (random GPT-2 payloads) are refused there.
    """

    methods: tuple[SIMethod, ...] = Field(SI_METHODS, min_length=1)
    base: SIBase = Field(
        "gpt2",
        description="gpt2: a GPT-2 of the shape below, pretrained here or not; smollm2: the pretrained "
        "SmolLM2-135M, fine-tuned",
    )
    corpus: Literal["auto", "chatterbot", "shakespeare", "licenses", "gettext_de_en"] = "auto"
    n_layer: int = Field(2, ge=1)
    n_embd: int = Field(64, ge=2)
    n_head: int = Field(2, ge=1)
    n_positions: int = Field(64, ge=2)
    max_len: int = Field(32, ge=4, description="training sequence length (prefix + response)")
    batch_size: int = Field(16, ge=1)
    max_pairs: int | None = Field(None, ge=10)
    pretrain_corpora: tuple[PretrainCorpus, ...] = ()
    pretrain_steps: int = Field(0, ge=0, description="0: no pretraining, the fine-tuned model starts at random")
    pretrain_lr: float = Field(1e-3, gt=0.0, description="peak; linear warm-up, cosine decay to a tenth")
    pretrain_warmup: int = Field(100, ge=0)
    pretrain_batch_size: int = Field(16, ge=1)
    pretrain_len: int = Field(64, ge=4, description="tokens per pretraining block (<= n_positions)")
    pretrain_eval_every: int = Field(250, ge=1, description="validation loss every this many steps")
    pretrain_seed: int | None = Field(
        None,
        ge=0,
        description="None: each seed pass pretrains its own GPT-2 (the pass's seed); a number: one GPT-2 "
        "pretrained with it is the common start of every seed pass, as one public pretrained checkpoint is",
    )
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
    # prompts the quality is scored on: the first n_prompts decrypted under MPC, the rest through each method's
    # plaintext twin (its decrypted tokens equal the twin's, measured as mpc_plain_token_agreement); 0: the MPC
    # prompts only
    quality_prompts: int = Field(0, ge=0)
    scaling_gen_lens: tuple[int, ...] = (4, 8, 16)
    scaling_methods: tuple[SIMethod, ...] = ("vanilla", "merge")
    scaling_sizes: tuple[ModelShape, ...] = ()
    networks: dict[str, NetworkSpec] = Field(
        default_factory=lambda: {
            "lan": NetworkSpec(bandwidth_gbps=10.0, rtt_ms=0.2),
            "wan": NetworkSpec(bandwidth_gbps=0.1, rtt_ms=40.0),
        }
    )
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    party_timeout_s: float = Field(900.0, gt=0.0)
    threads_per_party: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _lengths(self) -> SecureInferenceConfig:
        require_heads_divide(self, "n_embd", "n_head")
        longest = self.prefix_len + max((self.gen_len, *self.scaling_gen_lens)) - 1
        if longest > self.n_positions:
            raise ValueError(
                f"prefix_len {self.prefix_len} + the longest generation "
                f"{max((self.gen_len, *self.scaling_gen_lens))} - 1 = {longest} exceeds n_positions="
                f"{self.n_positions}; raise n_positions or shorten the generation"
            )
        if any(g < 1 for g in self.scaling_gen_lens):
            raise ValueError(f"scaling_gen_lens must all be >= 1, got {list(self.scaling_gen_lens)}")
        if (self.pretrain_steps > 0) != bool(self.pretrain_corpora):
            raise ValueError(
                f"pretrain_steps={self.pretrain_steps} with pretrain_corpora={list(self.pretrain_corpora)}: "
                "pretraining needs both (steps > 0 and at least one corpus), or neither"
            )
        if len(set(self.pretrain_corpora)) != len(self.pretrain_corpora):
            raise ValueError(f"pretrain_corpora must be distinct, got {list(self.pretrain_corpora)}")
        if self.pretrain_steps > 0 and self.pretrain_len > self.n_positions:
            raise ValueError(
                f"pretrain_len={self.pretrain_len} exceeds n_positions={self.n_positions}; lower pretrain_len"
            )
        if 0 < self.quality_prompts < self.n_prompts:
            raise ValueError(
                f"quality_prompts={self.quality_prompts} is below n_prompts={self.n_prompts}: quality is scored on "
                "the MPC prompts and more; raise quality_prompts or set it to 0 (the MPC prompts only)"
            )
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods must be distinct, got {list(self.methods)}")
        if self.base == "smollm2":
            self._check_smollm2()
        return self

    def _check_smollm2(self) -> None:
        if self.pretrain_steps > 0:
            raise ValueError(
                f"base=smollm2 is already pretrained: set secure_inference.pretrain_steps=0 (got "
                f"{self.pretrain_steps}) and pretrain_corpora=[]"
            )
        if self.scaling_gen_lens or self.scaling_sizes:
            raise ValueError(
                "base=smollm2 runs no length-scaling points (they time random GPT-2 payloads): set "
                "secure_inference.scaling_gen_lens=[] and scaling_sizes=[] (the mpc-generation bench scales lengths)"
            )

    @property
    def run_order(self) -> tuple[SIMethod, ...]:
        """The order a seed pass runs ``methods`` under MPC: as listed at an even ``seed``, reversed at an odd one,
        so that over consecutive seeds each pair of methods runs in both orders and a drift of the machine's speed
        favours neither side of a timing ratio (as the STIP timing alternates its two sides)."""
        return self.methods if self.seed % 2 == 0 else self.methods[::-1]

    @property
    def pretrain_seed_used(self) -> int:
        """The seed the pretrained GPT-2 is trained with: ``pretrain_seed``, or the pass's ``seed``."""
        return self.seed if self.pretrain_seed is None else self.pretrain_seed

    @property
    def n_quality(self) -> int:
        """How many prompts the quality is scored on (the MPC prompts first)."""
        return max(self.n_prompts, self.quality_prompts)

    @property
    def n_max(self) -> int:
        """The constant attention size of the merge modules: the longest sequence any run feeds them."""
        return self.prefix_len + max((self.gen_len, *self.scaling_gen_lens)) - 1
