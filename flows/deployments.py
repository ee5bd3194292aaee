"""Deployment entry points: flows whose parameters are a profile name and ``--set``-style overrides (what a
Prefect deployment, a schedule or the UI can pass), loading the validated config and running the stage's flow."""

from __future__ import annotations

from typing import Any

from prefect import flow

from core.errors import ConfigError
from flows.secure_inference import secure_inference_flow
from privbench.config import load_config


@flow(name="secure-inference-profile")
def secure_inference_profile(profile: str = "quick", overrides: list[str] | None = None) -> dict[str, Any]:
    """``privbench run secure-inference --profile PROFILE --set ...`` as a deployable flow (the ``gpu`` work
    pool's deployment in ``deploy/prefect.yaml``); runs on CPU unchanged where no GPU exists (``device: auto``)."""
    cfg = load_config(profile, overrides=tuple(overrides or ()))
    if cfg.secure_inference is None:
        raise ConfigError(f"profile {profile!r} has no secure_inference section")
    return secure_inference_flow(cfg.secure_inference, profile=profile)
