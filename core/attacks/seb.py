"""Subword Embedding from Bytes (SEB): a subword embedding with no parameter indexed by subword.

Paper: "Subword Embedding from Bytes Gains Privacy without Sacrificing Accuracy and Complexity" (SEB).

* Sec. 4.1 - every subword ``v`` of a vocabulary of size ``V_w`` is mapped to ``n`` bytes drawn uniformly with
  replacement from a byte vocabulary of size ``V_b``; a draw that repeats an existing byte sequence is redrawn, so
  the mapping ``M : V_w -> (V_b)^n`` is injective. ``M`` is a (V_w, n) int64 tensor.
* Sec. 4.2 - the subword embedding is a 2-layer FFN (ReLU between) of the aggregated byte representations:

  - ``ar``  (added real-valued):        FFN( sum_j B[M[v, j]] ),                 B: (V_b, byte_dim)
  - ``cr``  (concatenated real-valued): FFN( concat_j B[M[v, j]] ),  input n*byte_dim (row-major reshape)
  - ``co``  (concatenated one-hot):     FFN( concat_j onehot(M[v, j]) ), input n*V_b (Table 3's best variant)

* Sec. 4.3 - SEB holds O((n d + V_b) d) parameters instead of O(V_w d).

Why it defends against FILM-style attacks (Sec. 3.3, 5.1): a subword embedding's gradient is non-zero exactly
on the rows of the batch's subwords, which hands the attacker the bag of words. With SEB the only parameter
indexed by a discrete symbol is indexed by bytes (:attr:`SEBEmbedding.byte_weight`), and a single sentence
already touches most bytes, so the candidate set is close to the whole vocabulary. The output layer must not
re-introduce a subword-indexed parameter: :class:`SEBLMHead` scores ``hidden @ table().T``.
"""

from __future__ import annotations

import itertools
import math
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.errors import ConfigError, DataError

Variant = Literal["ar", "cr", "co"]
VARIANTS: tuple[str, ...] = ("ar", "cr", "co")
Output = Literal["seb", "tied", "subword"]
OUTPUTS: tuple[str, ...] = ("seb", "tied", "subword")

_MAX_RESAMPLE_ROUNDS = 16
_ENUMERABLE_SLOTS = 1 << 24


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {name}={value!r}")


def _duplicate_rows(rows: np.ndarray) -> np.ndarray:
    """Indices of rows that repeat an earlier row (the first occurrence is kept)."""
    _, first = np.unique(rows, axis=0, return_index=True)
    dup = np.ones(len(rows), dtype=bool)
    dup[first] = False
    return np.flatnonzero(dup)


def _fill_from_unused(rows: np.ndarray, dups: np.ndarray, byte_vocab: int, rng: np.random.Generator) -> None:
    """Give each duplicate row a uniformly drawn unused sequence (what rejection sampling converges to)."""
    n_bytes = rows.shape[1]
    powers = byte_vocab ** np.arange(n_bytes - 1, -1, -1, dtype=np.int64)  # (n,) base-V_b place values
    keep = np.setdiff1d(np.arange(len(rows)), dups)
    used = rows[keep] @ powers  # (kept,) integer codes
    unused = np.setdiff1d(np.arange(byte_vocab**n_bytes, dtype=np.int64), used)
    codes = rng.choice(unused, size=len(dups), replace=False)
    rows[dups] = (codes[:, None] // powers[None, :]) % byte_vocab  # (dups, n) digits of each code


def build_byte_mapping(vocab_size: int, *, n_bytes: int = 8, byte_vocab: int = 256, seed: int = 0) -> Tensor:
    """The subword -> byte-sequence mapping ``M`` of Sec. 4.1.

    Every row is ``n_bytes`` bytes drawn uniformly with replacement from ``[0, byte_vocab)``; rows that repeat an
    earlier row are redrawn until every row is unique. All rows are drawn at once and only the duplicates are
    redrawn, so (50257, 8) takes milliseconds. Deterministic per ``seed``.

    Returns:
        int64 tensor of shape (vocab_size, n_bytes) with values in [0, byte_vocab).
    """
    _check_positive(vocab_size=vocab_size, n_bytes=n_bytes, byte_vocab=byte_vocab)
    if byte_vocab < 2:
        raise ConfigError(f"byte_vocab must be >= 2 to tell subwords apart, got {byte_vocab=}; the paper uses 256")
    slots = byte_vocab**n_bytes
    if slots < vocab_size:
        raise ConfigError(
            f"no unique byte mapping exists: byte_vocab**n_bytes = {byte_vocab}**{n_bytes} = {slots} < "
            f"vocab_size={vocab_size}; raise n_bytes or byte_vocab so that byte_vocab**n_bytes >= vocab_size"
        )
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, byte_vocab, size=(vocab_size, n_bytes), dtype=np.int64)  # (V_w, n)
    for rounds in itertools.count():
        dups = _duplicate_rows(rows)
        if len(dups) == 0:
            break
        if rounds >= _MAX_RESAMPLE_ROUNDS and slots <= _ENUMERABLE_SLOTS:
            # near-full mappings only (vocab_size close to byte_vocab**n_bytes): rejection sampling would need
            # ~slots rounds for the last rows, so draw them directly from the unused sequences (same law)
            _fill_from_unused(rows, dups, byte_vocab, rng)
            break
        rows[dups] = rng.integers(0, byte_vocab, size=(len(dups), n_bytes), dtype=np.int64)
    return torch.from_numpy(rows)


def mapping_is_unique(mapping: Tensor) -> bool:
    """True when no two rows (subwords) of a (V_w, n) mapping share a byte sequence."""
    return int(torch.unique(mapping, dim=0).shape[0]) == int(mapping.shape[0])


def _check_mapping(mapping: Tensor, byte_vocab: int | None) -> int:
    """Validate a (V_w, n) mapping; returns the byte vocabulary size (inferred as max + 1 when None)."""
    if not isinstance(mapping, Tensor) or mapping.dim() != 2 or mapping.numel() == 0:
        shape = tuple(mapping.shape) if isinstance(mapping, Tensor) else type(mapping).__name__
        raise ConfigError(f"mapping must be a non-empty 2-D (vocab_size, n_bytes) tensor, got {shape}")
    if mapping.dtype.is_floating_point or mapping.dtype == torch.bool:
        raise ConfigError(f"mapping must hold integer byte ids, got dtype={mapping.dtype}; use build_byte_mapping")
    lo, hi = int(mapping.min()), int(mapping.max())
    vb = hi + 1 if byte_vocab is None else byte_vocab
    if lo < 0 or hi >= vb:
        raise ConfigError(f"mapping values must lie in [0, byte_vocab={vb}), got min={lo}, max={hi}")
    return vb


class SEBEmbedding(nn.Module):
    """Subword embeddings computed from bytes (Sec. 4.2): ``input_ids (...) -> (..., d_model)``.

    Args:
        mapping: (V_w, n) int64 subword -> bytes mapping (:func:`build_byte_mapping`); a persistent buffer.
        d_model: width of the produced subword embedding (d' of Sec. 4.2).
        variant: ``"ar"``, ``"cr"`` or ``"co"`` (Table 3).
        byte_dim: width of the real-valued byte embedding B (ar, cr); unused by co.
        hidden: hidden width of the 2-layer FFN.
        byte_vocab: V_b; inferred as ``mapping.max() + 1`` when None (pass it to be exact).

    Parameters: ar ``byte_emb (V_b, byte_dim)``, ``fc1 (byte_dim -> hidden)``; cr ``byte_emb``,
    ``fc1 (n*byte_dim -> hidden)``; co ``w1 (n*V_b, hidden)``, ``b1 (hidden,)``; all ``fc2 (hidden -> d_model)``.
    The co first layer is the one-hot Linear computed without one-hots: row ``j*V_b + M[v, j]`` of ``w1`` is
    summed over ``j`` (an ``embedding_bag``).

    Init: the first layer is scaled so every variant's pre-activation has unit variance (co ``w1`` ~ N(0, 1/n);
    ar/cr ``B`` ~ N(0, 1), ``fc1`` ~ N(0, 1/(n*byte_dim))), and ``fc2`` ~ N(0, init_std^2 / (hidden/2)) so the
    subword embeddings start with std ~``init_std``, like an ordinary embedding table (GPT-2: 0.02). Without
    this a tied/SEB output head starts with logits of std ~sqrt(d_model) and an initial loss far above ln V.
    """

    def __init__(
        self,
        mapping: Tensor,
        d_model: int,
        *,
        variant: Variant = "co",
        byte_dim: int = 64,
        hidden: int = 1024,
        byte_vocab: int | None = None,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ConfigError(f"unknown SEB variant {variant!r}; choose one of {VARIANTS} (Table 3)")
        _check_positive(d_model=d_model, byte_dim=byte_dim, hidden=hidden)
        if not init_std > 0:
            raise ConfigError(f"init_std must be > 0, got {init_std=}; 0.02 matches GPT-2's embedding init")
        self.byte_vocab = _check_mapping(mapping, byte_vocab)
        self.register_buffer("mapping", mapping.detach().to(torch.long).clone(), persistent=True)
        self.vocab_size, self.n_bytes = int(mapping.shape[0]), int(mapping.shape[1])
        self.variant, self.d_model, self.byte_dim, self.hidden = variant, d_model, byte_dim, hidden
        n, vb = self.n_bytes, self.byte_vocab
        if variant == "co":
            self.w1 = nn.Parameter(torch.randn(n * vb, hidden) / math.sqrt(n))  # (n*V_b, hidden)
            self.b1 = nn.Parameter(torch.zeros(hidden))
        else:
            self.byte_emb = nn.Embedding(vb, byte_dim)  # B: (V_b, byte_dim)
            self.fc1 = nn.Linear(byte_dim if variant == "ar" else n * byte_dim, hidden)
            nn.init.normal_(self.byte_emb.weight, std=1.0)
            nn.init.normal_(self.fc1.weight, std=1.0 / math.sqrt(n * byte_dim))
            nn.init.zeros_(self.fc1.bias)
        self.fc2 = nn.Linear(hidden, d_model)
        nn.init.normal_(self.fc2.weight, std=init_std / math.sqrt(hidden / 2))
        nn.init.zeros_(self.fc2.bias)
        offsets = torch.arange(n) * vb  # (n,) first row of position j in w1
        self.register_buffer("_offsets", offsets, persistent=False)

    @property
    def byte_weight(self) -> nn.Parameter:
        """The parameter whose rows are indexed by bytes; the FILM attack reads its non-zero gradient rows.

        ar/cr: the byte embedding B, (V_b, byte_dim); row b is byte b, whatever its position.
        co: the first FFN layer ``w1``, (n*V_b, hidden); row ``j*V_b + b`` is (position j, byte b). Its zero /
        non-zero gradient pattern therefore reveals, for every position j, the SET of bytes seen there - a
        stronger leak than the bag of bytes of ar/cr (candidates must match at every position), though still
        far from the bag of subwords once a batch covers most (position, byte) pairs.
        """
        return self.w1 if self.variant == "co" else self.byte_emb.weight

    def _check_ids(self, input_ids: Tensor) -> None:
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise DataError(f"input_ids must be integer token ids, got dtype={input_ids.dtype}")
        if input_ids.numel() == 0:
            return
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.vocab_size:
            raise DataError(
                f"token id out of range: got min id {lo}, max id {hi} for an SEB mapping of vocab_size="
                f"{self.vocab_size} - a tokenizer/model vocabulary mismatch; build the mapping with "
                f"build_byte_mapping(len(tokenizer)) or remap the ids into [0, {self.vocab_size})"
            )

    def _embed_flat(self, ids: Tensor) -> Tensor:
        """(m,) ids -> (m, d_model)."""
        bytes_ = self.mapping[ids]  # (m, n)
        if self.variant == "co":
            rows = bytes_ + self._offsets  # (m, n) rows j*V_b + M[v, j] of w1
            h = F.embedding_bag(rows, self.w1, mode="sum") + self.b1  # (m, hidden)
        elif self.variant == "ar":
            summed = F.embedding_bag(bytes_, self.byte_emb.weight, mode="sum")  # (m, byte_dim)
            h = self.fc1(summed)  # (m, hidden)
        else:
            e = self.byte_emb(bytes_)  # (m, n, byte_dim)
            concat = e.reshape(e.shape[0], self.n_bytes * self.byte_dim)  # (m, n*byte_dim), row-major
            h = self.fc1(concat)  # (m, hidden)
        return self.fc2(F.relu(h))  # (m, d_model)

    def forward(self, input_ids: Tensor) -> Tensor:
        """``input_ids`` of any shape (...) -> subword embeddings (..., d_model)."""
        self._check_ids(input_ids)
        out = self._embed_flat(input_ids.reshape(-1))  # (m, d_model), m = prod(...)
        return out.reshape(*input_ids.shape, self.d_model)  # (..., d_model)

    def table(self) -> Tensor:
        """Embeddings of the whole vocabulary, (V_w, d_model); co never builds a (V_w, n, hidden) tensor."""
        return self._embed_flat(torch.arange(self.vocab_size, device=self.mapping.device))

    def embedding_parameter_count(self) -> int:
        """All parameters of this module (the mapping is a buffer, not a parameter)."""
        return sum(p.numel() for p in self.parameters())

    def extra_repr(self) -> str:
        return (
            f"variant={self.variant!r}, vocab_size={self.vocab_size}, n_bytes={self.n_bytes}, "
            f"byte_vocab={self.byte_vocab}, byte_dim={self.byte_dim}, hidden={self.hidden}, d_model={self.d_model}"
        )


def seb_parameter_count(
    variant: Variant, *, d_model: int, hidden: int, n_bytes: int = 8, byte_vocab: int = 256, byte_dim: int = 64
) -> int:
    """The parameters of an :class:`SEBEmbedding` (Sec. 4.3), from its shape alone; the vocabulary does not enter
    (the mapping is a buffer). co: ``w1 (n*V_b, h)``, ``b1``; ar: ``B (V_b, byte_dim)``, ``fc1 (byte_dim -> h)``;
    cr: ``B``, ``fc1 (n*byte_dim -> h)``; all: ``fc2 (h -> d_model)``."""
    if variant not in VARIANTS:
        raise ConfigError(f"unknown SEB variant {variant!r}; choose one of {VARIANTS} (Table 3)")
    _check_positive(d_model=d_model, hidden=hidden, n_bytes=n_bytes, byte_vocab=byte_vocab, byte_dim=byte_dim)
    fc2 = hidden * d_model + d_model
    if variant == "co":
        return n_bytes * byte_vocab * hidden + hidden + fc2
    fan_in = byte_dim if variant == "ar" else n_bytes * byte_dim
    return byte_vocab * byte_dim + fan_in * hidden + hidden + fc2


def matched_hidden(
    budget: int, variant: Variant, *, d_model: int, n_bytes: int = 8, byte_vocab: int = 256, byte_dim: int = 64
) -> int:
    """The widest FFN hidden width whose SEB module has at most ``budget`` parameters: SEB at a subword table's
    size (``budget`` = its ``V_w x d_model``), the comparison at matched embedding parameters. The count is affine in
    the width, so the width is the budget less the fixed part over the per-unit part, rounded down.

    Raises:
        ConfigError: when even one hidden unit exceeds ``budget`` (the byte table alone may).
    """
    shape = {"d_model": d_model, "n_bytes": n_bytes, "byte_vocab": byte_vocab, "byte_dim": byte_dim}
    fixed = seb_parameter_count(variant, hidden=1, **shape)
    per_unit = seb_parameter_count(variant, hidden=2, **shape) - fixed
    if budget < fixed:
        raise ConfigError(
            f"an SEB_{variant} module needs {fixed} parameters at hidden width 1 ({shape}), more than the budget "
            f"{budget}; match a larger subword table (a larger vocabulary or d_model) or shrink n_bytes/byte_dim"
        )
    return 1 + (budget - fixed) // per_unit


class SEBLMHead(nn.Module):
    """Output layer over SEB embeddings: ``hidden (..., d_model) -> logits (..., V_w) = hidden @ table().T``.

    No parameter is indexed by subword, so the output-layer gradient does not leak the label subwords.
    """

    def __init__(self, seb: SEBEmbedding) -> None:
        super().__init__()
        if not isinstance(seb, SEBEmbedding):
            raise ConfigError(f"SEBLMHead needs an SEBEmbedding, got {type(seb).__name__}")
        self.seb = seb

    def forward(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden, self.seb.table())  # (..., d_model) @ (d_model, V_w) -> (..., V_w)


def install_seb(
    model: nn.Module,
    mapping: Tensor,
    *,
    variant: Variant = "co",
    byte_dim: int = 64,
    hidden: int = 1024,
    output: Output = "seb",
    byte_vocab: int | None = None,
) -> nn.Module:
    """Replace a Hugging Face causal LM's input embedding (and output layer) with SEB, in place; returns it.

    Works for models with ``get/set_input_embeddings`` and ``get/set_output_embeddings`` (GPT2LMHeadModel,
    LlamaForCausalLM). ``d_model`` is read from the current input embedding. ``output``:

    * ``"seb"``  - a second SEBEmbedding (same mapping, own parameters) in an :class:`SEBLMHead`; the input
      module's gradient then comes from the input path only (its byte rows are exactly those of the batch).
    * ``"tied"`` - :class:`SEBLMHead` over the input module: fewest parameters, but the input module's gradient
      mixes in the output path, which touches every byte row (the softmax scores the whole vocabulary).
    * ``"subword"`` - keep an untied ordinary (V_w, d_model) linear head. Its gradient rows leak the label
      subwords (the target's row gets a -(1 - p) term), so this is NO defence; for ablations only.

    Tying is switched off (``config.tie_word_embeddings = False`` and an empty tied-keys map) before the swap so
    ``tie_weights()`` cannot re-tie a subword head. The choice is recorded in ``model.config.seb``.
    """
    if output not in OUTPUTS:
        raise ConfigError(f"unknown SEB output {output!r}; choose one of {OUTPUTS}")
    old = model.get_input_embeddings()
    d_model = int(old.embedding_dim)
    vocab = int(model.config.vocab_size)
    if not isinstance(mapping, Tensor) or mapping.dim() != 2 or int(mapping.shape[0]) != vocab:
        rows = int(mapping.shape[0]) if isinstance(mapping, Tensor) and mapping.dim() >= 1 else None
        raise ConfigError(
            f"SEB mapping has {rows} rows but model.config.vocab_size={vocab} - a tokenizer/model vocabulary "
            f"mismatch; build it with build_byte_mapping({vocab}, ...)"
        )
    model.config.tie_word_embeddings = False
    if hasattr(model, "all_tied_weights_keys"):
        model.all_tied_weights_keys = {}
    device = old.weight.device
    init_std = float(getattr(model.config, "initializer_range", 0.02))
    kwargs = {
        "variant": variant,
        "byte_dim": byte_dim,
        "hidden": hidden,
        "byte_vocab": byte_vocab,
        "init_std": init_std,
    }
    seb = SEBEmbedding(mapping, d_model, **kwargs).to(device)
    head_old = model.get_output_embeddings()
    model.set_input_embeddings(seb)
    if output == "seb":
        model.set_output_embeddings(SEBLMHead(SEBEmbedding(mapping, d_model, **kwargs).to(device)))
    elif output == "tied":
        model.set_output_embeddings(SEBLMHead(seb))
    elif head_old is not None and head_old.weight is old.weight:  # "subword" on a tied model: untie by copy
        head_old.weight = nn.Parameter(old.weight.detach().clone())
    model.config.seb = {
        "variant": variant,
        "n_bytes": seb.n_bytes,
        "byte_vocab": seb.byte_vocab,
        "byte_dim": byte_dim,
        "hidden": hidden,
        "output": output,
    }
    return model
