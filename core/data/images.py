"""Small image classification sources for the tangent-model experiments: IDX (Fashion-MNIST) and sklearn digits.

**IDX format** (LeCun's MNIST format, also Fashion-MNIST): big-endian; a 4-byte magic
``0x00 0x00 <type> <ndim>`` (type 0x08 = unsigned byte, so images are ``0x00000803`` = 2051 and labels
``0x00000801`` = 2049), then ``ndim`` uint32 sizes, then ``prod(sizes)`` items in C order. Files may be
gzip-compressed (detected from the content, not the name). Fashion-MNIST ships as
``{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz``; Debian's ``dataset-fashion-mnist`` package puts
them in :data:`FASHION_MNIST_DIR`.

**Digits**: the data of scikit-learn's ``load_digits`` (1797 8x8 images, 10 classes, pixel values
0..16), read from the CSV bundled with scikit-learn without importing it (``core.data`` depends only on
numpy/torch), scaled to uint8 0..255 so both sources share one layout: images uint8 (N, H, W), labels int64 (N,).
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from core.errors import ConfigError, DataError

__all__ = [
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_DIR",
    "IDX_IMAGES_MAGIC",
    "IDX_LABELS_MAGIC",
    "ImageDataset",
    "Split",
    "fashion_mnist_files",
    "load_digits_images",
    "load_fashion_mnist",
    "random_subset",
    "read_idx",
    "read_idx_images",
    "read_idx_labels",
    "resize_images",
    "sklearn_digits_path",
    "split_train_test",
]

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
"""Where Debian's ``dataset-fashion-mnist`` installs the four ``*-ubyte.gz`` files."""
FASHION_MNIST_CLASSES: tuple[str, ...] = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip
IDX_IMAGES_MAGIC = 0x00000803  # 2051: unsigned byte, 3 dims (N, rows, cols)
IDX_LABELS_MAGIC = 0x00000801  # 2049: unsigned byte, 1 dim (N,)

Split = Literal["train", "test"]
_SPLIT_PREFIX = {"train": "train", "test": "t10k"}

# IDX type code -> big-endian numpy dtype
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def _read_bytes(path: Path) -> bytes:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"IDX file {path} does not exist; check the path (Fashion-MNIST: {FASHION_MNIST_DIR})")
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":  # gzip magic, whatever the name says
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise DataError(f"IDX file {path} looks gzip-compressed but cannot be decompressed: {exc}") from exc
    return raw


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Parse one IDX file (optionally gzip-compressed) into a native-endian numpy array.

    Args:
        path: the ``.idx*-ubyte`` or ``.gz`` file.
    Returns:
        array of shape ``(d_1, ..., d_ndim)`` from the header, dtype from the type code (uint8 for MNIST).
    Raises:
        DataError naming the file for a bad magic, an unknown type code, or a size mismatch.
    """
    return _parse_idx(_read_bytes(Path(path)), Path(path))[1]


def _parse_idx(raw: bytes, path: Path) -> tuple[int, np.ndarray]:
    """(magic number, array) of the IDX bytes ``raw`` read from ``path`` (named in errors)."""
    if len(raw) < 4:
        raise DataError(f"IDX file {path} is truncated: {len(raw)} bytes, need a 4-byte magic number")
    if raw[0] != 0 or raw[1] != 0:
        magic = int.from_bytes(raw[:4], "big")
        raise DataError(f"IDX file {path} has bad magic number 0x{magic:08x}; expected 0x0000TTNN (not an IDX file?)")
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        raise DataError(
            f"IDX file {path} has unknown type code 0x{code:02x}; known: {', '.join(f'0x{c:02x}' for c in _IDX_DTYPES)}"
        )
    if ndim < 1:
        raise DataError(f"IDX file {path} declares ndim=0; an IDX array needs at least one dimension")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"IDX file {path} is truncated: {len(raw)} bytes, header needs {header} for ndim={ndim}")
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = _IDX_DTYPES[code]
    expected = header + math.prod(dims) * dtype.itemsize
    if len(raw) != expected:
        raise DataError(
            f"IDX file {path} has {len(raw)} bytes but header dims {dims} need {expected} "
            f"({'truncated' if len(raw) < expected else 'trailing bytes'}); re-download the file"
        )
    arr = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return int.from_bytes(raw[:4], "big"), arr.astype(dtype.newbyteorder("="))


def _read_idx_file(path: str | os.PathLike[str], magic: int, kind: str, other: str) -> np.ndarray:
    """The array of the IDX file at ``path``, refused unless its magic is ``magic`` (a ``kind``, not an ``other``)."""
    path = Path(path)
    raw_magic, arr = _parse_idx(_read_bytes(path), path)
    if raw_magic != magic:
        raise DataError(
            f"IDX file {path} has magic {raw_magic} (0x{raw_magic:08x}), expected {magic} for {kind}; is it {other}?"
        )
    return arr


def read_idx_images(path: str | os.PathLike[str]) -> Tensor:
    """IDX image file (magic 2051) -> uint8 tensor (N, rows, cols)."""
    arr = _read_idx_file(path, IDX_IMAGES_MAGIC, "an image file (uint8, 3 dims)", "a labels file")
    return torch.from_numpy(arr)


def read_idx_labels(path: str | os.PathLike[str]) -> Tensor:
    """IDX label file (magic 2049) -> int64 tensor (N,)."""
    arr = _read_idx_file(path, IDX_LABELS_MAGIC, "a label file (uint8, 1 dim)", "an images file")
    return torch.from_numpy(arr.astype(np.int64))


def _require_tensor(value: object, dim: int, dtype: torch.dtype, requirement: str) -> None:
    """Raise DataError ``"<requirement>, got <dtype> <shape>"`` unless ``value`` is a ``dim``-d ``dtype`` tensor."""
    if isinstance(value, Tensor) and value.dim() == dim and value.dtype == dtype:
        return
    desc = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
    raise DataError(f"{requirement}, got {desc}")


@dataclass(frozen=True, eq=False)
class ImageDataset:
    """Images uint8 (N, H, W) with int64 labels (N,) in ``[0, n_classes)``; validated at construction."""

    images: Tensor
    labels: Tensor
    n_classes: int
    name: str = ""

    def __post_init__(self) -> None:
        label = self.name or "dataset"
        _require_tensor(self.images, 3, torch.uint8, f"{label}: images must be a uint8 (N, H, W) tensor")
        _require_tensor(self.labels, 1, torch.int64, f"{label}: labels must be an int64 (N,) tensor")
        if self.images.shape[0] != self.labels.shape[0]:
            raise DataError(
                f"{label}: {self.images.shape[0]} images but {self.labels.shape[0]} labels; "
                "the image and label files must belong together"
            )
        if isinstance(self.n_classes, bool) or not isinstance(self.n_classes, int) or self.n_classes < 1:
            raise ConfigError(f"n_classes must be an int >= 1, got n_classes={self.n_classes!r}")
        if self.labels.numel() and (int(self.labels.min()) < 0 or int(self.labels.max()) >= self.n_classes):
            raise DataError(
                f"{label}: labels range [{int(self.labels.min())}, {int(self.labels.max())}] "
                f"outside [0, {self.n_classes})"
            )

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def fashion_mnist_files(root: str | os.PathLike[str] = FASHION_MNIST_DIR, split: Split = "train") -> tuple[Path, Path]:
    """Paths ``(images, labels)`` of a Fashion-MNIST split under ``root`` (``.gz`` preferred, plain accepted).

    Raises DataError naming the missing file (install Debian's ``dataset-fashion-mnist`` or pass ``root``).
    """
    if split not in get_args(Split):
        raise ConfigError(f"unknown split={split!r}; known: {', '.join(get_args(Split))}")
    root = Path(root)
    found: list[Path] = []
    for kind in ("images-idx3", "labels-idx1"):
        stem = f"{_SPLIT_PREFIX[split]}-{kind}-ubyte"
        for cand in (root / f"{stem}.gz", root / stem):
            if cand.is_file():
                found.append(cand)
                break
        else:
            raise DataError(
                f"Fashion-MNIST file {root / (stem + '.gz')} not found; install the Debian package "
                f"dataset-fashion-mnist or pass root= the folder holding {stem}.gz"
            )
    return found[0], found[1]


def load_fashion_mnist(root: str | os.PathLike[str] = FASHION_MNIST_DIR, split: Split = "train") -> ImageDataset:
    """Fashion-MNIST split: images uint8 (N, 28, 28), labels int64 (N,) in [0, 10) (N = 60000 / 10000)."""
    img_path, lbl_path = fashion_mnist_files(root, split)
    images, labels = read_idx_images(img_path), read_idx_labels(lbl_path)
    if images.shape[0] != labels.shape[0]:
        raise DataError(f"{img_path} holds {images.shape[0]} images but {lbl_path} holds {labels.shape[0]} labels")
    return ImageDataset(images, labels, n_classes=len(FASHION_MNIST_CLASSES), name=f"fashion-mnist/{split}")


def sklearn_digits_path() -> Path:
    """Path of scikit-learn's bundled ``datasets/data/digits.csv.gz``, found without importing sklearn.

    ``core.data`` imports only numpy/torch (tests/core/data/test_registry.py), so the file is located
    with :func:`importlib.util.find_spec` (which does not execute the package) and parsed here.
    Raises DataError when scikit-learn is not installed or lacks the file.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the digits data ships with scikit-learn, which is not installed; pip install scikit-learn")
    for root in spec.submodule_search_locations:
        cand = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if cand.is_file():
            return cand
    raise DataError(
        f"scikit-learn at {list(spec.submodule_search_locations)} has no datasets/data/digits.csv.gz; "
        "pass the path of a digits CSV to load_digits_images(path=...)"
    )


def load_digits_images(path: str | os.PathLike[str] | None = None) -> ImageDataset:
    """The UCI optical digits as bundled with scikit-learn (same data as ``sklearn.datasets.load_digits``).

    The file is a (gzip) CSV of rows ``p_0, ..., p_63, label`` with pixels 0..16 in row-major 8x8 order.

    Args:
        path: the CSV (``.gz`` or plain); None -> :func:`sklearn_digits_path`.
    Returns:
        images uint8 (N, 8, 8) (0..16 scaled by 255/16 and rounded), labels int64 (N,) in [0, 10);
        N = 1797 for the bundled file.
    """
    path = sklearn_digits_path() if path is None else Path(path)
    if not path.is_file():
        raise DataError(f"digits file {path} does not exist; pass the path of digits.csv.gz")
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise DataError(f"digits file {path} looks gzip-compressed but cannot be decompressed: {exc}") from exc
    try:
        table = np.loadtxt(io.BytesIO(raw), delimiter=",", dtype=np.float64, ndmin=2)
    except ValueError as exc:
        raise DataError(f"digits file {path} is not a numeric CSV: {exc}") from exc
    if table.shape[0] == 0 or table.shape[1] != 65:
        raise DataError(
            f"digits file {path} has shape {table.shape}; expected rows of 64 pixels + 1 label (65 columns)"
        )
    pixels, target = table[:, :64], table[:, 64]
    if pixels.min() < 0 or pixels.max() > 16 or np.any(target != np.rint(target)):
        raise DataError(f"digits file {path}: pixels must lie in 0..16 and labels be integers")
    images = np.rint(pixels * (255.0 / 16.0)).astype(np.uint8).reshape(-1, 8, 8)
    labels = target.astype(np.int64)
    return ImageDataset(torch.from_numpy(images), torch.from_numpy(labels), n_classes=10, name="sklearn-digits")


def resize_images(
    x: Tensor, size: int | tuple[int, int], *, mode: Literal["bilinear", "area", "nearest"] = "bilinear"
) -> Tensor:
    """Resize a batch of images with :func:`torch.nn.functional.interpolate` (cheap patch inputs).

    Args:
        x: (N, H, W) or (N, C, H, W) images, any real dtype (uint8 is converted).
        size: output ``(H', W')`` or one int for a square output.
        mode: ``"bilinear"`` (antialiased when shrinking), ``"area"`` or ``"nearest"``.
    Returns:
        float32 tensor (N, H', W') or (N, C, H', W') on the input's value scale (uint8 stays 0..255).
    """
    given = size
    if isinstance(size, int) and not isinstance(size, bool):
        size = (size, size)
    if (
        not isinstance(size, tuple) or len(size) != 2
        or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in size)
    ):  # fmt: skip
        raise ConfigError(f"size must be an int >= 1 or a pair (H, W) of them, got size={given!r}")
    if mode not in ("bilinear", "area", "nearest"):
        raise ConfigError(f"unknown mode={mode!r}; known: bilinear, area, nearest")
    if not isinstance(x, Tensor) or x.dim() not in (3, 4) or x.dtype == torch.bool or x.is_complex():
        desc = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        raise DataError(f"images must be a real (N, H, W) or (N, C, H, W) tensor, got {desc}")
    squeeze = x.dim() == 3
    xf = x.unsqueeze(1) if squeeze else x
    xf = xf.to(torch.float32) if not xf.is_floating_point() else xf
    if mode == "bilinear":
        shrink = size[0] < xf.shape[-2] or size[1] < xf.shape[-1]
        out = F.interpolate(xf, size=size, mode="bilinear", align_corners=False, antialias=shrink)
    else:
        out = F.interpolate(xf, size=size, mode=mode)
    return out.squeeze(1) if squeeze else out


def random_subset(ds: ImageDataset, n: int | None, *, seed: int) -> ImageDataset:
    """``n`` examples of ``ds`` drawn without replacement by ``randperm(len(ds))`` from ``seed``, in that
    order (``n=None``: all, still in a seeded order). Raises DataError when ``n > len(ds)``."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ConfigError(f"n must be None or an int >= 1, got n={n!r}")
    if n is not None and n > len(ds):
        raise DataError(
            f"{ds.name or 'dataset'} has {len(ds)} examples, fewer than the n={n} asked for; "
            f"lower n to at most {len(ds)} or use None for all"
        )
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))[: n or len(ds)]
    return ImageDataset(ds.images[order], ds.labels[order], ds.n_classes, ds.name)


def split_train_test(ds: ImageDataset, test_fraction: float, *, seed: int) -> tuple[ImageDataset, ImageDataset]:
    """Seeded random split into (train, test) with ``round(test_fraction * n)`` test examples (at least one
    of each). For sources that ship without a split (digits)."""
    if not isinstance(test_fraction, int | float) or not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test_fraction must be in (0, 1), got test_fraction={test_fraction!r}")
    n = len(ds)
    n_test = min(max(round(test_fraction * n), 1), n - 1)
    if n < 2:
        raise DataError(f"{ds.name or 'dataset'} has {n} example(s); a train/test split needs at least 2")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    te, tr = order[:n_test], order[n_test:]
    return (
        ImageDataset(ds.images[tr], ds.labels[tr], ds.n_classes, f"{ds.name}/train"),
        ImageDataset(ds.images[te], ds.labels[te], ds.n_classes, f"{ds.name}/test"),
    )
