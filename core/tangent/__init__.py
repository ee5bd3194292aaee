"""Tangent Transformers (TAFT): linearised layers and a linearised HF ViT/Dinov2 wrapper.

See :mod:`core.tangent.layers` (eq. 5-12) and :mod:`core.tangent.model` (Sec. 3.1, 3.5, 5).
"""

from core.tangent.layers import (
    TangentAttention,
    TangentEmbeddings,
    TangentGELU,
    TangentLayerNorm,
    TangentLayerScale,
    TangentLinear,
    TangentModule,
    TangentPatchEmbedding,
    gelu_derivative,
    tangent_add,
)
from core.tangent.model import SUPPORTED_BLOCKS, TangentBlock, TangentModel, linearize_block, reinit_block_

__all__ = [
    "SUPPORTED_BLOCKS",
    "TangentAttention",
    "TangentBlock",
    "TangentEmbeddings",
    "TangentGELU",
    "TangentLayerNorm",
    "TangentLayerScale",
    "TangentLinear",
    "TangentModel",
    "TangentModule",
    "TangentPatchEmbedding",
    "gelu_derivative",
    "linearize_block",
    "reinit_block_",
    "tangent_add",
]
