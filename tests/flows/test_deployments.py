"""deploy/prefect.yaml: every deployment's entry point imports to a Prefect flow whose parameters it names, the
secure-inference deployment targets the gpu work pool, and its overrides validate against the profile."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import yaml

from pbconfig.benchmark import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_deployments_point_at_real_flows_and_valid_configs() -> None:
    spec = yaml.safe_load((ROOT / "deploy" / "prefect.yaml").read_text())
    names = {d["name"]: d for d in spec["deployments"]}
    assert names["secure-inference-gpu"]["work_pool"]["name"] == "gpu"
    for dep in spec["deployments"]:
        path, _, attr = dep["entrypoint"].partition(":")
        assert (ROOT / path).is_file(), dep["entrypoint"]
        fl = getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), attr)
        assert hasattr(fl, "fn") and hasattr(fl, "with_options"), f"{attr} is not a Prefect flow"
        params = dep.get("parameters", {})
        assert set(params) <= set(inspect.signature(fl.fn).parameters), dep["name"]
        cfg = load_config(params["profile"], overrides=tuple(params.get("overrides", ())))
        assert cfg.secure_inference is not None
