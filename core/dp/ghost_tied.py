r"""Ghost Clipping extended to the shared embedding: the baseline of DPFormer's Fig. 3 (Sec. 4, App. B).

DPFormer compares Phantom Clipping with Ghost Clipping (Li et al. 2022) applied to a model whose embedding
E (M, d) is tied to the output layer. In the paper's view (App. B, eq. B.1) E is an embedding layer used
twice: looked up at the L input ids (``e_s = a_s E``, a_s (L, M) one-hot) and at all M candidate tokens
of the output (``e_c = a_c E``, a_c (M, M) the one-hot encoding of [1, ..., M], i.e. the identity), with
``logits = H e_c^T``. Ghost Clipping evaluates the per-sample norm of an embedding's gradient
``a^T grad e`` as ``<a a^T, grad e grad e^T>`` (eq. B.3 / B.4), forming the two Gram matrices of its T
lookups. Applied to the shared E, whose per-sample gradient is ``a_s^T grad e_s + a_c^T grad e_c``, the
lookups are the L + M concatenated ids ``[x; 1..M]`` and

.. math:: ||g_E||^2 = <a a^T, \nabla e \nabla e^T>, \quad a = [a_s; a_c] \in \{0,1\}^{(L+M) \times M},
          \nabla e = [\nabla e_s; \nabla e_c] \in R^{(L+M) \times d},

with ``grad e_c = G^T H`` (M, d) per sample (G = dL/dlogits (L, M), H the output layer's input (L, d)).
The (B, L+M, L+M) Gram matrices are the O(B M^2 + B L^2) memory of the paper's complexity paragraph
(and the B L M cross blocks, the term ``<g_E^(1), g_E^(2)>`` of eq. B.2); DPFormer's eq. B.5 is the step
that removes them (``a_c a_c^T = I``). Nothing else differs from :class:`core.dp.phantom.PhantomClipping`:
the other layers use the same per-layer ghost / materialised norms (fastDP's mixed ghost clipping, on
which the paper builds its implementation), and the clipped sum is formed by the same book-keeping.
The result is exact, like Phantom Clipping; only the cost differs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from core.dp.phantom import PhantomClipping, _EmbeddingUse, _LinearUse


def gram_bytes(batch: int, seq_len: int, vocab: int, itemsize: int = 4) -> int:
    """Bytes of the two (B, L+M, L+M) Gram matrices of the shared embedding: float ``grad e grad e^T``
    and boolean ``a a^T``."""
    T = seq_len + vocab
    return batch * T * T * (itemsize + 1)


def ghost_tied_sq_norm(e: _EmbeddingUse, lin: _LinearUse) -> Tensor:
    """``<a a^T, grad e grad e^T>`` over the lookups ``[x; 1..M]`` of the shared embedding (B,)."""
    B, _, M = lin.grads.shape
    grad_ec = torch.bmm(lin.grads.transpose(1, 2), lin.acts)  # (B, M, d): grad e_c = G^T H
    candidates = torch.arange(M, device=e.ids.device).expand(B, M)  # (B, M): a_c = onehot(1..M)
    ids = torch.cat([e.ids, candidates], dim=1)  # (B, L+M)
    grads = torch.cat([e.grads, grad_ec.to(e.grads.dtype)], dim=1)  # (B, L+M, d)
    del grad_ec
    differ = ids.unsqueeze(2) != ids.unsqueeze(1)  # (B, L+M, L+M): 1 - a a^T, boolean
    gram = torch.bmm(grads, grads.transpose(1, 2))  # (B, L+M, L+M): grad e grad e^T
    return gram.masked_fill_(differ, 0.0).sum(dim=(1, 2))  # in place: no float copy of the mask


class GhostTiedClipping(PhantomClipping):
    """:class:`~core.dp.phantom.PhantomClipping` with the shared embedding's norm by Ghost Clipping over
    the L + M lookups (the paper's baseline) instead of Claim 4.1. Same interface and exactness."""

    tied_sq_norm = staticmethod(ghost_tied_sq_norm)
