"""privbench's config layer: the validated, frozen run configuration (one pydantic model per stage), where
privbench keeps its state (``settings``), the canonical form of a config (``canon``), and the offline
Prefect/MLflow environment defaults (``env``, applied on import).

It sits at the bottom of the import graph: it imports nothing of ours but ``core``. Importing the package is
cheap (it sets the environment defaults and ``__version__``); the public names below are loaded from their
submodule on first access, so ``from pbconfig import TrainDPConfig, get_settings`` works, while code inside the
repository imports the specific submodule (``from pbconfig.train_dp import TrainDPConfig``).

| module             | holds                                                                    |
|--------------------|--------------------------------------------------------------------------|
| `base`             | ``FrozenConfig`` (every model's base), ``ModelShape``, ``Epsilon``, ``Delta`` |
| `data`             | the ``prepare`` section: dataset, image, text and pretrained-model specs |
| `train_dp`         | ``TrainDPConfig``                                                        |
| `tangent`          | ``TangentConfig``, ``TangentDPConfig``                                   |
| `secure_inference` | ``SecureInferenceConfig``                                                |
| `stip`             | ``StipConfig``, ``StipModelSpec``                                        |
| `attacks`          | ``AttacksConfig`` and its parts                                          |
| `benchmark`        | ``BenchmarkConfig``, the profiles (``profiles/*.yaml``), ``load_config``, ``validate`` |
| `canon`            | ``canonical_json``, ``config_hash``, ``flatten``                         |
| `settings`         | ``get_settings`` (paths and URLs from the environment)                   |
| `env`              | the offline environment defaults                                         |
| `claims`           | the claims registry (``load_claims``) and the profile history            |
| `verdicts`         | ``Verdict``, the verdict classes (no pydantic: the CLI colours them)     |
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pbconfig import env as _env  # noqa: F401  - offline Prefect/MLflow defaults, before either is imported

__version__ = "0.1.0"

_EXPORTS = {
    "base": ("FrozenConfig", "ModelShape", "Epsilon", "Delta"),
    "data": (
        "DATASET_FORMATS",
        "SyntheticSpec",
        "DatasetSpec",
        "ImageDatasetSpec",
        "TextDatasetSpec",
        "PretrainedSpec",
        "PrepareConfig",
    ),
    "train_dp": ("TRAIN_METHODS", "PEER_METHODS", "TrainDatasetSpec", "TrainDPConfig"),
    "tangent": ("TANGENT_REGIMES", "TASK_RUNNERS", "TangentDPConfig", "TangentConfig"),
    "secure_inference": ("SI_METHODS", "SIMethod", "NetworkSpec", "SecureInferenceConfig"),
    "stip": ("StipModelSpec", "StipConfig"),
    "attacks": (
        "EMBEDDINGS",
        "Embedding",
        "FILM_SETTINGS",
        "MIA_ATTACKS",
        "SEBSpec",
        "ModelShapeSpec",
        "PriorSpec",
        "FilmConfig",
        "UtilityConfig",
        "AuditConfig",
        "AttacksConfig",
    ),
    "benchmark": ("CONFIG_DIR", "PROFILES", "BenchmarkConfig", "load_config", "validate"),
    "canon": ("canonical_json", "config_hash", "flatten"),
    "settings": ("DASK_ENV", "DASK_SCHEMES", "Settings", "parse_dask_address", "get_settings"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "CONFIG_DIR",
    "DASK_ENV",
    "DASK_SCHEMES",
    "DATASET_FORMATS",
    "EMBEDDINGS",
    "FILM_SETTINGS",
    "MIA_ATTACKS",
    "PEER_METHODS",
    "PROFILES",
    "SI_METHODS",
    "TANGENT_REGIMES",
    "TASK_RUNNERS",
    "TRAIN_METHODS",
    "AttacksConfig",
    "AuditConfig",
    "BenchmarkConfig",
    "DatasetSpec",
    "Delta",
    "Embedding",
    "Epsilon",
    "FilmConfig",
    "FrozenConfig",
    "ImageDatasetSpec",
    "ModelShape",
    "ModelShapeSpec",
    "NetworkSpec",
    "PrepareConfig",
    "PretrainedSpec",
    "PriorSpec",
    "SEBSpec",
    "SIMethod",
    "SecureInferenceConfig",
    "Settings",
    "StipConfig",
    "StipModelSpec",
    "SyntheticSpec",
    "TangentConfig",
    "TangentDPConfig",
    "TextDatasetSpec",
    "TrainDPConfig",
    "TrainDatasetSpec",
    "UtilityConfig",
    "__version__",
    "canonical_json",
    "config_hash",
    "flatten",
    "get_settings",
    "load_config",
    "parse_dask_address",
    "validate",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'pbconfig' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"pbconfig.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})


if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from pbconfig.attacks import (
        EMBEDDINGS,
        FILM_SETTINGS,
        MIA_ATTACKS,
        AttacksConfig,
        AuditConfig,
        Embedding,
        FilmConfig,
        ModelShapeSpec,
        PriorSpec,
        SEBSpec,
        UtilityConfig,
    )
    from pbconfig.base import Delta, Epsilon, FrozenConfig, ModelShape
    from pbconfig.benchmark import CONFIG_DIR, PROFILES, BenchmarkConfig, load_config, validate
    from pbconfig.canon import canonical_json, config_hash, flatten
    from pbconfig.data import (
        DATASET_FORMATS,
        DatasetSpec,
        ImageDatasetSpec,
        PrepareConfig,
        PretrainedSpec,
        SyntheticSpec,
        TextDatasetSpec,
    )
    from pbconfig.secure_inference import SI_METHODS, NetworkSpec, SecureInferenceConfig, SIMethod
    from pbconfig.settings import DASK_ENV, DASK_SCHEMES, Settings, get_settings, parse_dask_address
    from pbconfig.stip import StipConfig, StipModelSpec
    from pbconfig.tangent import TANGENT_REGIMES, TASK_RUNNERS, TangentConfig, TangentDPConfig
    from pbconfig.train_dp import PEER_METHODS, TRAIN_METHODS, TrainDatasetSpec, TrainDPConfig
