"""Sequential-recommendation models of DPFormer (App. E.2) and their per-sequence loss."""

from core.models.attention import CausalSelfAttention, ScoreCorrection, attention_mask
from core.models.loss import sequence_loss
from core.models.seqrec import (
    PADDING_ID,
    RNNSeqRec,
    SeqRecConfig,
    SeqRecModel,
    TransformerSeqRec,
    build_seqrec,
)

__all__ = [
    "PADDING_ID",
    "CausalSelfAttention",
    "RNNSeqRec",
    "ScoreCorrection",
    "SeqRecConfig",
    "SeqRecModel",
    "TransformerSeqRec",
    "attention_mask",
    "build_seqrec",
    "sequence_loss",
]
