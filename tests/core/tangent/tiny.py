"""The tiny ViT / Dinov2 configuration every TAFT test builds its random backbone from."""

from __future__ import annotations

import transformers


def tiny_config(cls: type = transformers.Dinov2Config, **kw: object) -> transformers.PretrainedConfig:
    """hidden 32, 3 blocks, 2 heads, 28 px single-channel images cut in 7 px patches; ``kw`` overrides."""
    base = {
        "hidden_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "image_size": 28,
        "patch_size": 7,
        "num_channels": 1,
    }
    base.update(kw)
    return cls(**base)
