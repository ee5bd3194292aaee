"""Claim 4.1 at the ``dp-clipping`` bench's shape: Phantom Clipping's per-sample gradient norms against the norms
of per-sample gradients from one backward pass per sample (the slow, obviously correct reference), in float64."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from privbench.bench.dp_clipping import Setting


def norm_exactness(setting: Setting, batch: int = 4) -> dict[str, Any]:
    """Claim 4.1's exactness at the bench's shape: the per-sample gradient norms Phantom Clipping computes (the
    strategy the bench times) against the norms of per-sample gradients from one backward pass per sample, in
    float64, dropout off (one forward per sample must see the same network), on ``batch`` random sequences."""
    import torch

    from core.dp.phantom import PhantomClipping
    from core.models import SeqRecConfig, build_seqrec, sequence_loss
    from privbench.bench.dp_clipping_worker import random_batch

    torch.manual_seed(setting.seed)
    cfg = SeqRecConfig(
        num_items=setting.items,
        max_len=setting.seq_len,
        d_model=setting.d_model,
        n_heads=setting.n_heads,
        n_layers=setting.n_layers,
        dropout=0.0,
        tied=True,
    )
    model = build_seqrec(cfg).to(torch.float64).train()
    inputs, targets = random_batch(setting.items, setting.seq_len, batch, setting.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    reference = []
    for i in range(batch):
        loss = sequence_loss(model(inputs[i : i + 1]), targets[i : i + 1], reduction="none").sum()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        reference.append(torch.sqrt(sum(g.pow(2).sum() for g in grads if g is not None)))
    expected = torch.stack(reference)
    with PhantomClipping(model) as phantom:
        norms = phantom.per_sample_norms(sequence_loss(model(inputs), targets, reduction="none"))
    rel = ((norms.detach() - expected).abs() / expected.clamp_min(1e-300)).max().item()
    return {"batch": batch, "phantom_norm_max_rel_err": rel, "dtype": "float64"}
