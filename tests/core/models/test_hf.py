"""One HF model load or construction at a time (``core.models.hf``): transformers swaps process-wide functions while
it loads a model, so a model built meanwhile in another thread comes out wrong; under the lock it waits instead."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import nullcontext

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.initialization import no_tie_weights
from transformers.modeling_utils import PreTrainedModel

from core.models import hf

CFG = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, tie_word_embeddings=True)


def _tied(model: torch.nn.Module) -> bool:
    return model.lm_head.weight is model.transformer.wte.weight


def _while_loading(build: Callable[[], torch.nn.Module], *, locked: bool) -> torch.nn.Module:
    """``build()`` in this thread while another thread is inside a load's ``no_tie_weights`` (holding the lock as
    ``hf.load`` does when ``locked``)."""
    inside, done = threading.Event(), threading.Event()

    def loading() -> None:
        with hf.exclusive() if locked else nullcontext(), no_tie_weights():
            inside.set()
            done.wait(timeout=0.5)  # a load takes a while; the builder below either waits or runs inside it

    thread = threading.Thread(target=loading)
    thread.start()
    assert inside.wait(timeout=10)
    try:
        return build()
    finally:
        done.set()
        thread.join()


def test_a_model_built_during_a_load_waits_for_it_and_comes_out_tied() -> None:
    original = PreTrainedModel.tie_weights
    started = time.perf_counter()
    model = _while_loading(lambda: hf.build(GPT2LMHeadModel, CFG), locked=True)
    assert _tied(model) and time.perf_counter() - started >= 0.4  # it waited for the load to end
    assert PreTrainedModel.tie_weights is original


def test_without_the_lock_the_same_build_comes_out_untied() -> None:
    """The failure the lock prevents, shown deterministically (the check above can fail)."""
    model = _while_loading(lambda: GPT2LMHeadModel(CFG), locked=False)
    assert not _tied(model)


def test_concurrent_loads_and_builds_leave_every_model_tied_and_transformers_as_it_was(tmp_path) -> None:
    GPT2LMHeadModel(CFG).save_pretrained(tmp_path)
    original = PreTrainedModel.tie_weights
    built: list[torch.nn.Module] = []
    errors: list[BaseException] = []

    def loads() -> None:
        try:
            for _ in range(6):
                built.append(hf.load(GPT2LMHeadModel.from_pretrained, tmp_path))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def builds() -> None:
        try:
            for _ in range(30):
                built.append(hf.build(GPT2LMHeadModel, CFG))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=f) for f in (loads, loads, builds)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(built) == 42 and all(_tied(m) for m in built)
    assert PreTrainedModel.tie_weights is original


@pytest.mark.parametrize("depth", [1, 3])
def test_the_lock_is_reentrant(depth: int) -> None:
    def nested(n: int) -> torch.nn.Module:
        if n == 0:
            return hf.build(GPT2LMHeadModel, CFG)
        with hf.exclusive():
            return nested(n - 1)

    assert _tied(nested(depth))
