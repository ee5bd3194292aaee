"""`privbench bench stip` on a tiny config-built GPT-2 (the real SmolLM2 runs in the benchmark itself)."""

from __future__ import annotations

import math

import pytest

from core.errors import ConfigError
from core.stip.keys import SECRET_SOURCE
from privbench.bench import run_benchmark, stip


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        stip.PROFILES,
        "quick",
        stip.Setting(
            model="gpt2-config",
            prompt_len=4,
            gen_len=2,
            repeats=1,
            attack_queries=8,
            stream_tokens=2000,
            timeout_s=120,
            finetune_noises=(0.0, 0.1),
        ),
    )


def test_contract_keys(home, tiny) -> None:
    out = run_benchmark("stip", profile="quick")
    for key in ("server_over_plaintext_time", "server_over_plaintext_same_work_time", "user_overhead_fraction"):
        assert math.isfinite(out["ratios"][key]) and out["ratios"][key] > 0
    assert 0 <= out["errors"]["max_abs_err"] < 1e-4
    assert out["targets"]["exact_in_float64"] and out["errors"]["float64_max_rel_err"] <= 1e-9
    assert set(out["bytes_per_token"]) == {"user_embed", "vocab_perm"}
    assert all(v["up"] > 0 and v["down"] > 0 for v in out["bytes_per_token"].values())
    assert set(out["attacks"]) == {"checkpoint_match", "activation_stats", "frequency"}
    assert all(0 <= a["recovery_rate"] <= 1 for a in out["attacks"].values())
    assert out["attacks"]["checkpoint_match"]["recovery_rate"] == 1.0
    assert set(out["recovery"]) == {"user_embed", "vocab_perm"}
    table = out["recovery"]["vocab_perm"]["table"]
    assert set(table) == {"checkpoint", "none", "strongest"} and set(table["checkpoint"]["sigma"]) == {"0", "0.1"}
    assert out["targets"]["checkpoint_sigma_ge_99pct_up_to_10pct"]
    assert out["targets"]["checkpoint_tokens_ge_99pct_up_to_10pct"]
    assert out["setting"]["secret_source"] == SECRET_SOURCE  # the source is reported, never a secret or its seed
    with pytest.raises(ConfigError, match="unknown profile 'huge'"):
        run_benchmark("stip", profile="huge")
