"""FILM with the real pretrained SmolLM2-135M prior against a SmolLM2-architecture victim (a known answer)."""

from __future__ import annotations

import pytest
import torch

from core.attacks.evaluate import attack_batches
from core.attacks.llama_victim import SMOLLM2_EOS, smollm2_tokenizer, smollm2_victim
from core.attacks.priors import HFPrior
from core.attacks.seb import build_byte_mapping

pytestmark = pytest.mark.slow  # loads the real weights (~20-40 s) and runs the attack with a 135M-parameter prior

SENTENCE = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate."


@pytest.fixture(scope="module")
def smollm2() -> torch.nn.Module:
    pytest.importorskip("gguf")
    from core.stip.models import load_smollm2

    return load_smollm2().eval()


def test_batch_one_subword_victim_is_recovered(smollm2: torch.nn.Module) -> None:
    tok = smollm2_tokenizer()
    mapping = build_byte_mapping(49152, n_bytes=8, byte_vocab=256, seed=0)
    victim = smollm2_victim("subword", smollm2, n_layer=1, mapping=None, byte_dim=8, hidden=8, seed=0)
    [result] = attack_batches(
        victim,
        [[tok.encode(SENTENCE)]],
        victim="subword",
        settings=["subwords"],
        mapping=mapping,
        byte_vocab=256,
        prior=HFPrior(smollm2, bos_id=SMOLLM2_EOS),
        decode=tok.decode,
        beam_width=8,
        reorder_passes=1,
        relaxed_random=0,
        seed=0,
        reorder_moves=64,
        eos_id=SMOLLM2_EOS,
    )
    assert result.recall == 1.0 and result.n_candidates == len(set(tok.encode(SENTENCE)))
    assert result.rouge1 >= 0.9, (result.best_recovered, result.rouge1)
