"""Pre-registration of the claims registry, checked against git: every claim names the commit that registered
it, and every change of a registered rule (its measure, rule, precondition or scale) since then is in the
claim's ``history`` with the old and the new value (and a reason; ``docs/claims.md``)."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from pbconfig.claims import CLAIMS_DIR, STAGE_SECTIONS, Claim, ProfileChange, load_claims, load_profile_history

ROOT = Path(__file__).resolve().parent.parent
RULE_FIELDS = ("measure", "rule", "precondition", "applies_at")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def _history_available() -> bool:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return False
    return _git("rev-parse", "--is-shallow-repository").strip() == "false"


needs_git = pytest.mark.skipif(not _history_available(), reason="needs the repository's full git history")


def _rule_fields(raw: dict[str, Any]) -> dict[str, Any]:
    return {k: raw.get(k) for k in RULE_FIELDS}


@cache
def versions() -> list[tuple[str, dict[str, dict[str, Any]]]]:
    """(commit, {claim id: its rule fields}) for every commit that touched the registry, oldest first, then the
    working tree (commit ``""``)."""
    out = []
    folder = CLAIMS_DIR.relative_to(ROOT).as_posix()
    for commit in _git("log", "--reverse", "--format=%H", "--", folder).split():
        claims: dict[str, dict[str, Any]] = {}
        for name in _git("ls-tree", "--name-only", commit, f"{folder}/").split():
            if name.endswith(".yaml"):
                doc = yaml.safe_load(_git("show", f"{commit}:{name}")) or {}
                claims |= {c["id"]: _rule_fields(c) for c in doc.get("claims", [])}
        out.append((commit, claims))
    tree = {}
    for path in sorted(CLAIMS_DIR.glob("*.yaml")):
        tree |= {c["id"]: _rule_fields(c) for c in yaml.safe_load(path.read_text()).get("claims", [])}
    out.append(("", tree))
    return out


def _norm(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def diff(old: Any, new: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """The changed leaves between two versions of a claim's rule fields, as (dotted path, old, new)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new)) for d in diff(old.get(k), new.get(k), f"{path}.{k}".lstrip("."))]
    return [] if _norm(old) == _norm(new) else [(path, _norm(old), _norm(new))]


def changes(claim_id: str) -> tuple[str | None, list[tuple[str, list[tuple[str, Any, Any]]]]]:
    """The commit that registered ``claim_id`` ("" for the working tree) and each later change: (commit, diffs)."""
    registered, previous, out = None, None, []
    for commit, claims in versions():
        if claim_id not in claims:
            continue
        if registered is None:
            registered = commit
        elif (found := diff(previous, claims[claim_id])) and previous is not None:
            out.append((commit, found))
        previous = claims[claim_id]
    return registered, out


def covered(path: str, old: Any, new: Any, claim: Claim) -> bool:
    """Whether a history entry of ``claim`` records this change: the same field with the same old and new value,
    or a whole object (``applies_at``) whose given parts hold the changed leaf."""
    for entry in claim.history:
        for key, (was, now) in entry.change.items():
            if key == path and _norm(was) == old and _subset(_norm(now), new):
                return True
            if path.startswith(f"{key}."):
                rest = path[len(key) + 1 :].split(".")

                def leaf(value: Any, rest: list[str] = rest) -> Any:
                    for part in rest:
                        value = value.get(part) if isinstance(value, dict) else None
                    return _norm(value)

                if leaf(was) == old and leaf(now) == new:
                    return True
    return False


def _subset(given: Any, actual: Any) -> bool:
    """``given`` equals ``actual``, or is a dict whose entries ``actual`` holds (an object recorded in part)."""
    if isinstance(given, dict) and isinstance(actual, dict):
        return all(k in actual and _subset(v, actual[k]) for k, v in given.items())
    return given == actual


CLAIMS = load_claims()


@needs_git
@pytest.mark.parametrize("claim", CLAIMS, ids=[c.id for c in CLAIMS])
def test_every_rule_change_since_registration_is_in_the_history(claim: Claim) -> None:
    registered, found = changes(claim.id)
    assert registered is not None
    missing = [
        f"{commit[:7] or 'working tree'}: {path}: {old!r} -> {new!r}"
        for commit, diffs in found
        for path, old, new in diffs
        if not covered(path, old, new, claim)
    ]
    assert not missing, (
        f"claim {claim.id!r}: rule changes since its registration with no history entry (old and new value, "
        f"date, the old rule's verdict, a reason citing no result): {missing}"
    )


@needs_git
@pytest.mark.parametrize("claim", CLAIMS, ids=[c.id for c in CLAIMS])
def test_registration_commit_is_the_one_that_added_the_claim(claim: Claim) -> None:
    registered, found = changes(claim.id)
    if registered == "":
        assert claim.registered.commit is None, f"claim {claim.id!r} is not committed yet: registered.commit is None"
        return
    assert claim.registered.commit is not None and registered.startswith(claim.registered.commit), (
        f"claim {claim.id!r}: registered.commit is {claim.registered.commit}, but it was added by {registered[:7]}"
    )
    change_commits = {commit for commit, _ in found}
    for entry in claim.history:
        if entry.commit is None:  # recorded before it was committed: only a change of the working tree
            assert "" in change_commits, (
                f"claim {claim.id!r}: the history entry of {entry.date} has no commit but its change is committed: "
                "set its commit"
            )
        elif any(f"{entry.commit}".startswith(c[:7]) or c.startswith(entry.commit) for c in change_commits if c):
            continue
        else:  # a change outside the registry's own rule fields (a profile's data) names the commit that made it
            assert _git("cat-file", "-t", entry.commit).strip() == "commit", (claim.id, entry.commit)


def test_the_check_catches_an_unrecorded_change() -> None:
    """The checker fails on a hand-made case: a bound moved with no history entry, and passes with one."""
    claim = CLAIMS[0]
    moved = diff(
        _rule_fields({"rule": {"kind": "above", "bound": 0}}), _rule_fields({"rule": {"kind": "above", "bound": 1}})
    )
    assert moved == [("rule.bound", 0, 1)]
    assert not covered("rule.bound", 0, 1, claim.model_copy(update={"history": ()}))
    entry = {"date": "2026-11-27", "change": {"rule.bound": [0, 1]}, "verdict_before": "none", "reason": "x" * 20}
    with_entry = Claim.model_validate(claim.model_dump() | {"history": [entry]})
    assert covered("rule.bound", 0, 1, with_entry)
    assert not covered("rule.bound", 0, 2, with_entry)


# Profile data: every change of a reported profile's stage section (the data, recipe or budget each claim of the stage
# reads) after this commit is in configs/history/profiles.yaml. Earlier changes were recorded by hand where a review
# found one after a result (the claims' own history entries name them).
PROFILE_GUARD_FROM = "535135a"
REPORTED_PROFILES = ("quick", "reference")


def _sections(doc: dict[str, Any] | None) -> dict[str, Any]:
    doc = doc or {}
    return {section: doc.get(section) for section in STAGE_SECTIONS.values()}


@cache
def profile_versions(profile: str) -> list[tuple[str, dict[str, Any]]]:
    """(commit, stage sections) of ``configs/<profile>.yaml`` at ``PROFILE_GUARD_FROM`` and at every later commit
    that touched it, oldest first, then the working tree (commit ``""``)."""
    path = f"configs/{profile}.yaml"
    out = [(PROFILE_GUARD_FROM, _sections(yaml.safe_load(_git("show", f"{PROFILE_GUARD_FROM}:{path}"))))]
    for commit in _git("log", "--reverse", "--format=%H", f"{PROFILE_GUARD_FROM}..HEAD", "--", path).split():
        out.append((commit, _sections(yaml.safe_load(_git("show", f"{commit}:{path}")))))
    out.append(("", _sections(yaml.safe_load((ROOT / path).read_text()))))
    return out


def unrecorded_profile_changes(
    profile: str, versions: list[tuple[str, dict[str, Any]]], history: tuple[ProfileChange, ...]
) -> list[str]:
    """Each (commit, section) whose stage section changed between consecutive ``versions`` with no entry of
    ``history`` for that profile, section and commit (an entry with no commit covers the working tree only)."""
    missing = []
    for (_, old), (commit, new) in itertools.pairwise(versions):
        for section in STAGE_SECTIONS.values():
            if _norm(old.get(section)) == _norm(new.get(section)):
                continue
            found = any(
                profile in h.profiles
                and h.section == section
                and ((h.commit is None and commit == "") or (h.commit is not None and commit.startswith(h.commit)))
                for h in history
            )
            if not found:
                missing.append(f"{commit[:7] or 'working tree'}: {profile}.{section} changed")
    return missing


@needs_git
@pytest.mark.parametrize("profile", REPORTED_PROFILES)
def test_every_profile_change_since_the_guard_is_recorded(profile: str) -> None:
    missing = unrecorded_profile_changes(profile, profile_versions(profile), load_profile_history())
    assert not missing, (
        f"changes of the {profile} profile's stage sections with no entry in configs/history/profiles.yaml (date, "
        f"commit, profiles, section, the changed keys old -> new, the stage's verdicts before, a reason citing no "
        f"result): {missing}"
    )


@needs_git
def test_recorded_profile_changes_name_real_commits() -> None:
    for h in load_profile_history():
        if h.commit is not None:
            assert _git("cat-file", "-t", h.commit).strip() == "commit", h


def test_the_profile_check_catches_an_unrecorded_change() -> None:
    """A hand-made case: the epochs of train_dp moved with no entry is caught; an entry for it clears it; an entry
    for another section or profile does not."""
    before = {"train_dp": {"epochs": 20}, "attacks": None}
    after = {"train_dp": {"epochs": 10}, "attacks": None}
    versions = [("a" * 40, before), ("b" * 40, after)]
    assert unrecorded_profile_changes("reference", versions, ()) == ["bbbbbbb: reference.train_dp changed"]
    entry = {
        "date": "2026-11-28",
        "commit": "bbbbbbb",
        "profiles": ["reference"],
        "section": "train_dp",
        "change": {"epochs": [20, 10]},
        "verdict_before": "reference: not reproduced",
        "reason": "the two-hour budget of the whole profile (the time an epoch takes)",
    }
    assert unrecorded_profile_changes("reference", versions, (ProfileChange.model_validate(entry),)) == []
    other = ProfileChange.model_validate(entry | {"section": "tangent"})
    assert unrecorded_profile_changes("reference", versions, (other,)) != []
    quick_only = ProfileChange.model_validate(entry | {"profiles": ["quick"]})
    assert unrecorded_profile_changes("reference", versions, (quick_only,)) != []


def test_a_bad_profile_history_is_refused_by_name(tmp_path: Path) -> None:
    """An entry without a reason (or with an unknown section) is refused with the file's name, not half-loaded."""
    from core.errors import ConfigError

    bad = tmp_path / "profiles.yaml"
    bad.write_text(
        "changes:\n  - {date: 2026-11-28, profiles: [reference], section: train_dp, change: {epochs: [20, 10]}, "
        "verdict_before: none}\n"
    )
    with pytest.raises(ConfigError, match=r"(?s)profile history profiles\.yaml: .*reason"):
        load_profile_history(bad)
    bad.write_text(
        "changes:\n  - {date: 2026-11-28, profiles: [reference], section: training, change: {epochs: [20, 10]}, "
        "verdict_before: none, reason: the two-hour budget of the whole profile}\n"
    )
    with pytest.raises(ConfigError, match="section"):
        load_profile_history(bad)
