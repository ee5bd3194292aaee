"""Frozen, validated run configuration: one object is the Prefect flow parameter, the MLflow params
(flattened) and the ``config_json`` of the results row.

Profiles live in ``configs/<name>.yaml``; ``--config FILE`` replaces the profile file and
``--set key=value`` overrides single values (``--set prepare.datasets.0.synthetic.scale=0.5``). Every bad
value is refused before anything runs, with a message that names the key, the value and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import Field, ValidationError, model_validator

from core.errors import ConfigError
from pbconfig.attacks import AttacksConfig
from pbconfig.base import FrozenConfig
from pbconfig.data import PrepareConfig
from pbconfig.secure_inference import SecureInferenceConfig
from pbconfig.stip import StipConfig
from pbconfig.tangent import TangentConfig
from pbconfig.train_dp import TrainDPConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"  # the YAML run profiles, at the repository root
PROFILES = ("quick", "reference", "paper")
ConfigT = TypeVar("ConfigT", bound=FrozenConfig)


def _not_prepared(subject: str, section: str, prepared: set[str], *, one: bool = False) -> ValueError:
    """The error of a section that reads ``subject`` (a field and the names it gives) where ``prepare.<section>``
    prepares only ``prepared``."""
    verb, pronoun = ("is", "it") if one else ("are", "them")
    return ValueError(
        f"{subject} {verb} not prepared; add {pronoun} to prepare.{section} or pick from {sorted(prepared)}"
    )


class BenchmarkConfig(FrozenConfig):
    """The whole chain. Later stages add their sections here."""

    profile: str = Field("quick", pattern=r"^[a-z0-9_-]+$")
    prepare: PrepareConfig
    train_dp: TrainDPConfig | None = None
    tangent: TangentConfig | None = None
    secure_inference: SecureInferenceConfig | None = None
    stip: StipConfig | None = None
    attacks: AttacksConfig | None = None

    @model_validator(mode="after")
    def _tangent_on_prepared(self) -> BenchmarkConfig:
        if self.tangent is not None:
            images = {d.name for d in self.prepare.images}
            models = {m.name for m in self.prepare.models}
            if self.tangent.dataset not in images:
                raise _not_prepared(f"tangent.dataset {self.tangent.dataset!r}", "images", images, one=True)
            if self.tangent.model not in models:
                raise _not_prepared(f"tangent.model {self.tangent.model!r}", "models", models, one=True)
        return self

    @model_validator(mode="after")
    def _train_on_prepared(self) -> BenchmarkConfig:
        if self.train_dp is not None:
            prepared = {d.name for d in self.prepare.datasets}
            missing = [d.name for d in self.train_dp.datasets if d.name not in prepared]
            if missing:
                raise _not_prepared(f"train_dp.datasets {missing}", "datasets", prepared)
        return self

    @model_validator(mode="after")
    def _attacks_on_prepared(self) -> BenchmarkConfig:
        if self.attacks is not None:
            prepared = {d.name for d in self.prepare.texts}
            missing = [n for n in self.attacks.text_datasets() if n not in prepared]
            if missing:
                raise _not_prepared(f"attacks reads text datasets {missing} that", "texts", prepared)
            audit = self.attacks.audit
            if audit is not None:
                if self.train_dp is None:
                    raise ValueError(
                        "attacks.audit trains with the train_dp section's hyperparameters; add a "
                        "train_dp section or remove attacks.audit"
                    )
                trained = {d.name for d in self.train_dp.datasets}
                missing = [n for n in audit.datasets if n not in trained]
                if missing:
                    raise ValueError(
                        f"attacks.audit.datasets {missing} are not in train_dp.datasets; pick from {sorted(trained)}"
                    )
                if audit.unlearning and self.tangent is None:
                    raise ValueError(
                        "attacks.audit.unlearning audits the tangent stage's composed model; add a "
                        "tangent section or set attacks.audit.unlearning: false"
                    )
        return self


# ----------------------------------------------------------------------------------------------- loading


def load_config(
    profile: str = "quick", *, config_file: str | Path | None = None, overrides: tuple[str, ...] = ()
) -> BenchmarkConfig:
    """Build the config from a profile (or a YAML file) and ``key=value`` overrides, validated."""
    raw = _read_yaml(config_file) if config_file is not None else _read_yaml(_profile_path(profile))
    base = validate(BenchmarkConfig, raw, origin=str(config_file or _profile_path(profile)))
    return with_overrides(base, overrides)


def with_overrides(
    config: ConfigT, overrides: tuple[str, ...], *, example: str = "prepare.datasets.0.min_interactions=10"
) -> ConfigT:
    """``config`` with ``key=value`` overrides (``--set``) applied and validated again, as a new object.

    An unknown key is refused with the known keys at its level, a bad value with pydantic's reason (ConfigError,
    naming the key and the value); ``example`` is the ``key=value`` shown when an item has no ``=``."""
    if not overrides:
        return config
    tree = config.model_dump(mode="json")
    for item in overrides:
        _apply_override(tree, item, example)
    return validate(type(config), tree, origin="--set " + " ".join(overrides))


def validate(model: type[FrozenConfig], data: Any, *, origin: str) -> Any:
    """``model.model_validate(data)`` with pydantic's errors turned into one readable ``ConfigError``."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, origin)) from None


def _profile_path(profile: str) -> Path:
    path = CONFIG_DIR / f"{profile}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown profile {profile!r}; known profiles: {', '.join(known)} (in {CONFIG_DIR})")
    return path


def _read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass an existing YAML file to --config")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level, got {type(data).__name__}")
    return data


def _apply_override(tree: dict[str, Any], item: str, example: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects key=value, got {item!r}; e.g. --set {example}")
    parts = key.strip().split(".")
    node: Any = tree
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        where = ".".join(parts[:depth]) or "<top level>"
        if isinstance(node, dict):
            if part not in node:
                raise ConfigError(
                    f"--set {item!r}: unknown key {part!r} under {where}; known keys: {', '.join(sorted(node))}"
                )
            if last:
                node[part] = _parse_value(text)
            node = node[part]
        elif isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"--set {item!r}: {where} is a list of {len(node)}; use an index 0..{len(node) - 1}")
            if last:
                node[int(part)] = _parse_value(text)
            node = node[int(part)]
        else:
            raise ConfigError(f"--set {item!r}: {where} is a value, not a section; it has no key {part!r}")


def _parse_value(text: str) -> Any:
    """YAML scalar semantics: ``10`` -> int, ``0.5`` -> float, ``true`` -> bool, ``null`` -> None."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _format_validation_error(exc: ValidationError, origin: str) -> str:
    lines = [f"invalid configuration ({origin}):"]
    errors = exc.errors()
    bad_items = {tuple(e["loc"][:-1]) for e in errors if e["loc"] and isinstance(e["loc"][-1], int)}
    for err in errors:
        if err["type"] == "too_short" and tuple(err["loc"]) in bad_items:
            continue  # the length of a tuple whose bad item was dropped: the item's own error says it all
        loc = ".".join(str(p) for p in err["loc"]) or "<top level>"
        if err["type"] == "extra_forbidden":
            lines.append(f"  {loc}: unknown key (remove it or check the spelling)")
            continue
        value = err.get("input")
        shown = repr(value) if not isinstance(value, dict) else "{...}"
        lines.append(f"  {loc} = {shown}: {err['msg']}")
    return "\n".join(lines)
