"""Like-for-like timing of P2 against the plaintext model: both sides built and run the same way, every object built
before the timed parts, an untimed warm-up, and the order of the two timed parts alternating over the rounds (ABBA).
No test here reads a real clock for its verdict: the order bias is simulated with a fake clock."""

from __future__ import annotations

import pytest
import torch

import core.stip.parties as P
from core.errors import ConfigError
from core.models.gpt2 import tiny_gpt2
from core.stip import evaluate as E
from core.stip.models import randomize_norms, tiny_llama
from core.stip.parties import Cloud, Developer, run_stip_inprocess
from tests.core.stip.tiny import stip_gpt2

PROMPT = [5, 17, 42, 3, 9]
N_NEW = 4


def _gpt2(attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = tiny_gpt2(97, n_layer=2, n_embd=32, n_head=4, dropout=0.0, eos_token_id=0, attn_implementation=attn)
    return randomize_norms(model, 0).eval()


@torch.no_grad()
def _greedy(model: torch.nn.Module, prompt: list[int], n_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(n_new):
        ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "make", [lambda: _gpt2("eager"), lambda: _gpt2("sdpa"), tiny_llama], ids=["eager", "sdpa", "llama"]
)
@pytest.mark.parametrize("design", ["user_embed", "vocab_perm"])
def test_plaintext_service_is_built_like_p2(make, design):
    """Same class, attention implementation (the model's own, on both sides) and dtype; a fresh instance each; and
    the plaintext service generates what the model itself generates."""
    model = make()
    cloud = Cloud(Developer(model, design=design).packages()[0])
    plain = P._plain_service(model)
    own = model.config._attn_implementation
    assert type(plain.base) is type(cloud.base) is type(P.base_model_of(model))
    assert plain.base.config._attn_implementation == cloud.base.config._attn_implementation == own
    assert {p.dtype for p in plain.base.parameters()} == {p.dtype for p in cloud.base.parameters()} == {torch.float32}
    assert plain.base is not P.base_model_of(model) and plain.base is not cloud.base
    assert P._plain_run(plain, torch.tensor(PROMPT), N_NEW).tokens == _greedy(model, PROMPT, N_NEW)


@pytest.mark.parametrize("plaintext_first", [True, False])
def test_a_run_builds_everything_then_times_the_two_sides_in_the_order_asked(monkeypatch, plaintext_first):
    events: list[str] = []

    def record(name, real):
        def wrapped(*args, **kwargs):
            events.append(name)
            return real(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(P.Developer, "packages", record("package", P.Developer.packages))
    monkeypatch.setattr(P.Cloud, "__init__", record("build", P.Cloud.__init__))
    monkeypatch.setattr(P.User, "__init__", record("build", P.User.__init__))
    monkeypatch.setattr(P, "_plain_run", record("plaintext", P._plain_run))
    monkeypatch.setattr(P, "user_generate", record("protocol", P.user_generate))
    r = run_stip_inprocess(stip_gpt2(), PROMPT, N_NEW, design="vocab_perm", plaintext_first=plaintext_first)
    timed = ["plaintext", "protocol"] if plaintext_first else ["protocol", "plaintext"]
    assert events == ["package", "build", "build", "build", *timed]  # P2, P3, the plaintext service; then timing
    assert r.tokens_match


class _FakeClock:
    """Time moves only when read: ``tick`` per reading. The timed parts of the parties read it (``P._clock``) the
    same number of times per step on both sides (``Cloud.step``), so without bias P2's step and the plaintext
    service's take the same fake time; ``bias`` multiplies the tick during the first timed part of every round."""

    def __init__(self, bias: float) -> None:
        self.now, self.tick, self.bias = 0.0, 1.0, bias

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


@pytest.fixture
def biased(monkeypatch):
    """``run(bias, rounds, order)``: ``protocol_costs`` on the tiny GPT-2 (``vocab_perm``, where P2's step and the
    plaintext service's are the same code) under a fake clock that makes the first timed part of every round
    ``bias`` times slower; returns the result and the order of the timed parts (warm-up first)."""
    model = stip_gpt2()
    monkeypatch.setattr(E, "run_stip", lambda model, prompt, n_new, *, design, timeout_s: _ThreeProcesses())
    monkeypatch.setattr(E, "float64_exactness", lambda model, prompt, n_new, *, design: {})

    def run(bias: float, rounds: int, order: str = "abba") -> tuple[dict, list[str]]:
        clock, parts = _FakeClock(bias), []

        def timed(name, real):
            def wrapped(*args, **kwargs):
                first = len(parts) % 2 == 0  # two timed parts per round, warm-up included
                parts.append(name)
                clock.tick = clock.bias if first else 1.0
                try:
                    return real(*args, **kwargs)
                finally:
                    clock.tick = 1.0

            return wrapped

        with monkeypatch.context() as m:
            m.setattr(P, "_clock", clock)
            m.setattr(P, "_plain_run", timed("plaintext", P._plain_run))
            m.setattr(P, "user_generate", timed("protocol", P.user_generate))
            out = E.protocol_costs(model, torch.tensor(PROMPT), N_NEW, design="vocab_perm", repeats=rounds,
                                   timeout_s=1.0, order=order)  # fmt: skip
        return out, parts

    return run


class _ThreeProcesses:
    """What ``protocol_costs`` reads of the three-process run (stubbed: no processes in these tests)."""

    tokens = plain_tokens = (1,)
    tokens_match = True
    max_abs_logit_error = max_rel_logit_error = 0.0
    bytes_up_per_token = bytes_down_per_token = 1.0
    setup_bytes_p1_to_p2 = setup_bytes_p1_to_p3 = 1
    wall_seconds = 1.0


def test_rounds_alternate_the_order_after_one_warm_up(biased):
    out, parts = biased(1.0, 6)
    pairs = [tuple(parts[i : i + 2]) for i in range(0, len(parts), 2)]
    p_s, s_p = ("plaintext", "protocol"), ("protocol", "plaintext")
    assert pairs == [p_s, p_s, s_p, p_s, s_p, p_s, s_p]  # the warm-up, then round r plaintext first iff r is even
    assert out["timing_order"] == "abba" and out["timing_rounds"] == 6
    assert out["server_over_plaintext_same_work_time"] == 1.0  # unbiased fake clock: the same work, the same time
    assert out["server_over_plaintext_same_work_time_lo"] == out["server_over_plaintext_same_work_time_hi"] == 1.0
    assert out["round_ratios"] == [1.0] * 6  # every round kept, in order
    _, fixed = biased(1.0, 3, order="fixed")
    assert fixed == ["plaintext", "protocol"] * 4


def test_an_order_bias_moves_the_fixed_order_and_not_the_abba_median(biased):
    """The first timed part of every round 25% slower. In the old fixed order (plaintext first) every round puts
    it on the plaintext side: the protocol seems 20% faster than the same work in plaintext, with a 95% interval
    excluding 1. ABBA puts it on each side in half the rounds: the median stays within 3% of 1 (the bias enters at
    second order, (b + 1/b) / 2 - 1) and the interval covers 1."""
    bias = 1.25
    fixed, _ = biased(bias, 8, order="fixed")
    assert fixed["server_over_plaintext_same_work_time"] == pytest.approx(1 / bias)
    assert fixed["server_over_plaintext_same_work_time_hi"] == pytest.approx(1 / bias)  # the interval excludes 1
    abba, _ = biased(bias, 8)
    assert abba["server_over_plaintext_same_work_time"] == pytest.approx((bias + 1 / bias) / 2)
    assert abs(abba["server_over_plaintext_same_work_time"] - 1) < 0.03
    assert abba["server_over_plaintext_same_work_time_lo"] == pytest.approx(1 / bias)
    assert abba["server_over_plaintext_same_work_time_hi"] == pytest.approx(bias)
    assert abba["round_ratios"] == pytest.approx([bias if r % 2 else 1 / bias for r in range(8)])  # who went first


def test_unknown_order_is_refused_before_any_run(monkeypatch):
    monkeypatch.setattr(E, "run_stip", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(ConfigError, match="timing order"):
        E.protocol_costs(None, None, 2, design="user_embed", repeats=7, timeout_s=1.0, order="random")
