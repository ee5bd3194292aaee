"""IDX parser (Fashion-MNIST format), digits loader and resize, on small synthetic files in the real format."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from core.data.images import (
    FASHION_MNIST_DIR,
    IDX_IMAGES_MAGIC,
    IDX_LABELS_MAGIC,
    ImageDataset,
    fashion_mnist_files,
    load_digits_images,
    load_fashion_mnist,
    read_idx,
    read_idx_images,
    read_idx_labels,
    resize_images,
)
from core.errors import ConfigError, DataError


def _idx_bytes(arr: np.ndarray, code: int = 0x08) -> bytes:
    header = bytes([0, 0, code, arr.ndim]) + b"".join(struct.pack(">I", d) for d in arr.shape)
    return header + arr.astype(arr.dtype.newbyteorder(">")).tobytes()


def _write(path: Path, data: bytes, gz: bool) -> Path:
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def _fake_fmnist(root: Path, split: str, n: int, gz: bool = True) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n, dtype=np.uint8)
    prefix = {"train": "train", "test": "t10k"}[split]
    suffix = ".gz" if gz else ""
    _write(root / f"{prefix}-images-idx3-ubyte{suffix}", _idx_bytes(images), gz)
    _write(root / f"{prefix}-labels-idx1-ubyte{suffix}", _idx_bytes(labels), gz)
    return images, labels


def test_magic_constants() -> None:
    assert IDX_IMAGES_MAGIC == 2051 and IDX_LABELS_MAGIC == 2049
    assert _idx_bytes(np.zeros((1, 28, 28), np.uint8))[:4] == struct.pack(">I", 2051)


@pytest.mark.parametrize("gz", [True, False])
def test_roundtrip_images_and_labels(tmp_path: Path, gz: bool) -> None:
    images, labels = _fake_fmnist(tmp_path, "train", 7, gz=gz)
    suffix = ".gz" if gz else ""
    x = read_idx_images(tmp_path / f"train-images-idx3-ubyte{suffix}")
    y = read_idx_labels(tmp_path / f"train-labels-idx1-ubyte{suffix}")
    assert x.dtype == torch.uint8 and x.shape == (7, 28, 28)
    assert y.dtype == torch.int64 and y.shape == (7,)
    assert np.array_equal(x.numpy(), images) and np.array_equal(y.numpy(), labels.astype(np.int64))


def test_gzip_detected_from_content_not_name(tmp_path: Path) -> None:
    arr = np.arange(6, dtype=np.uint8)
    p = _write(tmp_path / "labels.bin", _idx_bytes(arr), gz=True)
    assert np.array_equal(read_idx(p), arr)


def test_other_type_codes_big_endian(tmp_path: Path) -> None:
    arr = np.array([[1, -2], [300, 40000]], dtype=np.int32)
    p = _write(tmp_path / "ints.idx", _idx_bytes(arr, code=0x0C), gz=False)
    out = read_idx(p)
    assert out.dtype == np.int32 and np.array_equal(out, arr)


def test_load_fashion_mnist_synthetic(tmp_path: Path) -> None:
    images, _ = _fake_fmnist(tmp_path, "test", 5)
    ds = load_fashion_mnist(tmp_path, "test")
    assert isinstance(ds, ImageDataset) and len(ds) == 5 and ds.n_classes == 10
    assert ds.name == "fashion-mnist/test"
    assert np.array_equal(ds.images.numpy(), images)
    img_path, lbl_path = fashion_mnist_files(tmp_path, "test")
    assert img_path.name == "t10k-images-idx3-ubyte.gz" and lbl_path.name == "t10k-labels-idx1-ubyte.gz"


def test_bad_magic_names_file(tmp_path: Path) -> None:
    _fake_fmnist(tmp_path, "train", 3)
    labels = tmp_path / "train-labels-idx1-ubyte.gz"
    with pytest.raises(DataError, match=r"train-labels-idx1-ubyte\.gz has magic 2049.*expected 2051"):
        read_idx_images(labels)
    images = tmp_path / "train-images-idx3-ubyte.gz"
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte\.gz has magic 2051.*expected 2049"):
        read_idx_labels(images)
    junk = _write(tmp_path / "junk.idx", b"\x12\x34\x08\x01" + b"\x00" * 8, gz=False)
    with pytest.raises(DataError, match=r"junk\.idx has bad magic number 0x12340801"):
        read_idx(junk)
    code = _write(tmp_path / "code.idx", b"\x00\x00\x07\x01\x00\x00\x00\x01\x00", gz=False)
    with pytest.raises(DataError, match=r"code\.idx has unknown type code 0x07"):
        read_idx(code)


def test_size_checks_name_file(tmp_path: Path) -> None:
    good = _idx_bytes(np.zeros((2, 28, 28), np.uint8))
    short = _write(tmp_path / "short-images.gz", good[:-10], gz=True)
    with pytest.raises(DataError, match=r"short-images\.gz has 1574 bytes.*need 1584 \(truncated\)"):
        read_idx_images(short)
    long = _write(tmp_path / "long-images", good + b"\x00", gz=False)
    with pytest.raises(DataError, match=r"long-images .*trailing bytes"):
        read_idx_images(long)
    header = _write(tmp_path / "header.idx", b"\x00\x00\x08\x03\x00\x00", gz=False)
    with pytest.raises(DataError, match=r"header\.idx is truncated"):
        read_idx(header)
    with pytest.raises(DataError, match=r"missing\.gz does not exist"):
        read_idx(tmp_path / "missing.gz")
    bad_gz = _write(tmp_path / "bad.gz", b"\x1f\x8b" + b"garbage", gz=False)
    with pytest.raises(DataError, match=r"bad\.gz looks gzip-compressed"):
        read_idx(bad_gz)


def test_count_mismatch_and_missing_file(tmp_path: Path) -> None:
    _fake_fmnist(tmp_path, "train", 4)
    _write(tmp_path / "train-labels-idx1-ubyte.gz", _idx_bytes(np.zeros(3, np.uint8)), gz=True)
    with pytest.raises(DataError, match="4 images but .* 3 labels"):
        load_fashion_mnist(tmp_path, "train")
    with pytest.raises(DataError, match=r"t10k-images-idx3-ubyte\.gz not found"):
        load_fashion_mnist(tmp_path, "test")
    with pytest.raises(ConfigError, match="split='val'"):
        load_fashion_mnist(tmp_path, "val")  # type: ignore[arg-type]


def test_image_dataset_validation() -> None:
    x = torch.zeros(2, 4, 4, dtype=torch.uint8)
    with pytest.raises(DataError, match="uint8"):
        ImageDataset(x.float(), torch.zeros(2, dtype=torch.long), n_classes=2)
    with pytest.raises(DataError, match="outside"):
        ImageDataset(x, torch.tensor([0, 2]), n_classes=2)
    with pytest.raises(ConfigError, match="n_classes=0"):
        ImageDataset(x, torch.zeros(2, dtype=torch.long), n_classes=0)


def test_resize_images() -> None:
    x = torch.arange(2 * 28 * 28, dtype=torch.float32).reshape(2, 28, 28) % 256
    out = resize_images(x.to(torch.uint8), 14)
    assert out.shape == (2, 14, 14) and out.dtype == torch.float32
    assert 0.0 <= out.min().item() and out.max().item() <= 255.0
    const = torch.full((1, 3, 8, 8), 7, dtype=torch.uint8)
    up = resize_images(const, (16, 12))
    assert up.shape == (1, 3, 16, 12)
    torch.testing.assert_close(up, torch.full((1, 3, 16, 12), 7.0))
    area = resize_images(torch.ones(1, 4, 4), 2, mode="area")
    torch.testing.assert_close(area, torch.ones(1, 2, 2))
    with pytest.raises(ConfigError, match="size=0"):
        resize_images(x, 0)
    with pytest.raises(ConfigError, match="mode='cubic'"):
        resize_images(x, 4, mode="cubic")  # type: ignore[arg-type]
    with pytest.raises(DataError, match=r"\(N, H, W\)"):
        resize_images(torch.zeros(28, 28), 14)


def test_load_digits_matches_sklearn() -> None:
    datasets = pytest.importorskip("sklearn.datasets", reason="scikit-learn not installed")
    ds = load_digits_images()
    assert ds.images.shape == (1797, 8, 8) and ds.images.dtype == torch.uint8
    assert ds.labels.dtype == torch.int64 and ds.n_classes == 10
    ref = datasets.load_digits()
    assert np.array_equal(ds.labels.numpy(), ref.target)
    assert np.array_equal(ds.images.numpy(), np.rint(ref.images * 255 / 16).astype(np.uint8))
    assert int(ds.images.max()) == 255 and int(ds.images.min()) == 0


def test_load_digits_csv_synthetic(tmp_path: Path) -> None:
    rows = np.zeros((3, 65))
    rows[0, 0], rows[1, 63], rows[:, 64] = 16, 8, [0, 9, 3]
    text = "\n".join(",".join(str(int(v)) for v in r) for r in rows).encode()
    ds = load_digits_images(_write(tmp_path / "d.csv.gz", text, gz=True))
    assert ds.images.shape == (3, 8, 8) and ds.labels.tolist() == [0, 9, 3]
    assert int(ds.images[0, 0, 0]) == 255 and int(ds.images[1, 7, 7]) == 128  # rint(8 * 255 / 16) = 128
    bad = _write(tmp_path / "bad.csv", b"1,2,3\n", gz=False)
    with pytest.raises(DataError, match=r"bad\.csv has shape \(1, 3\)"):
        load_digits_images(bad)
    with pytest.raises(DataError, match=r"nope\.csv does not exist"):
        load_digits_images(tmp_path / "nope.csv")


@pytest.mark.skipif(
    not (FASHION_MNIST_DIR / "t10k-images-idx3-ubyte.gz").is_file(),
    reason=f"Debian package dataset-fashion-mnist not installed ({FASHION_MNIST_DIR} missing)",
)
def test_real_fashion_mnist() -> None:
    test = load_fashion_mnist(split="test")
    assert test.images.shape == (10000, 28, 28) and test.labels.shape == (10000,)
    assert torch.bincount(test.labels).tolist() == [1000] * 10
    train = load_fashion_mnist(split="train")
    assert train.images.shape == (60000, 28, 28)
    assert torch.bincount(train.labels).tolist() == [6000] * 10
