"""The canonical form of a config: its JSON (sorted keys, compact), the sha256 of that JSON (the results row's
``config_hash``) and the dotted-key flattening logged as MLflow params."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel


def config_hash(config: BaseModel) -> str:
    """Stable sha256 of the canonical JSON of a config (key order and float repr independent of input)."""
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()


def canonical_json(config: BaseModel) -> str:
    return json.dumps(config.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def flatten(config: BaseModel | dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Flatten to dotted keys for MLflow params: ``{"prepare.datasets.0.name": "ml-100k", ...}``."""
    tree = config.model_dump(mode="json") if isinstance(config, BaseModel) else config
    out: dict[str, str] = {}

    def walk(node: Any, key: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{key}.{i}")
        else:
            out[key] = "null" if node is None else str(node)

    walk(tree, prefix)
    return out
