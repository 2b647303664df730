"""Build the real-world corpus of the zoo: public architectures exported by torch.onnx.

    python models/corpus/build.py                    # every model, both exporters
    python models/corpus/build.py bert llama         # the named architectures only
    python models/corpus/build.py --list             # the architectures and what they are

Each architecture is built with random weights (torch.manual_seed) at a small configuration
and exported twice, as users export it:
- NAME_ts:     the TorchScript exporter, torch.onnx.export(dynamo=False), opset 17;
- NAME_dynamo: the torch.export-based exporter, torch.onnx.export(dynamo=True), opset 18
               (with its default onnxscript optimization).
The graphs are written to models/corpus/NAME_{ts,dynamo}.onnx without their weight values:
onnxfuse.zoo.strip_weights replaces each large float initializer by a seeded record, which the
zoo turns back into a tensor on load (models/README.md). models/manifest.json gets one entry per
export (source "corpus"), with two settings of the symbolic dims for the regression suite.

Needs torch, torchvision and transformers (the versions are in the written models' producer
fields and in models/README.md); nothing that reads the corpus does.
"""
from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import click
import onnx

HERE = Path(__file__).resolve().parent
MODELS = HERE.parent
sys.path.insert(0, str(MODELS.parent))  # onnxfuse from the checkout, for the weight records
from onnxfuse.zoo import MANIFEST, strip_weights  # noqa: E402

EXPORTERS = {"ts": ("torchscript", 17), "dynamo": ("dynamo", 18)}
SEED = 20261125
# Transformers at a small configuration: quick to run, the same graph structure as the real sizes.
TEXT_DIMS = ({"batch": 2, "seq": 16}, {"batch": 1, "seq": 7})
IMAGE_DIMS = ({"batch": 1}, {"batch": 2})


@dataclass
class Case:
    """One architecture: how to build it, its example inputs and which axes are symbolic."""

    name: str
    family: str  # "transformer", "rnn", "cnn"
    description: str
    build: Callable  # () -> (torch.nn.Module, dict of example inputs, dict input -> {axis: dim name})
    outputs: list[str]
    shape_sets: tuple = TEXT_DIMS
    input_notes: dict = field(default_factory=dict)
    slow: bool = False  # the regression suite checks it only with the slow tests (manifest "slow")


# --------------------------------------------------------------------------- architectures


def _ids(vocab: int, batch: int = 2, seq: int = 16):
    import torch

    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[1, seq - 4:] = 0  # a padded row, so the export traces the padding mask for real
    return ids, mask


class _Encoder:
    """forward(input_ids, attention_mask) -> last_hidden_state, for transformers models."""

    @staticmethod
    def wrap(model):
        import torch

        class Wrapped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask):
                out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False) \
                    if "use_cache" in self.model.forward.__code__.co_varnames else \
                    self.model(input_ids=input_ids, attention_mask=attention_mask)
                return out.last_hidden_state

        return Wrapped().eval()


TEXT_AXES = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}


def bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64)
    ids, mask = _ids(1000)
    return _Encoder.wrap(BertModel(cfg, add_pooling_layer=False)), {"input_ids": ids, "attention_mask": mask}, TEXT_AXES


def gpt2():
    from transformers import GPT2Config, GPT2Model

    cfg = GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                     eos_token_id=0)
    ids, mask = _ids(1000)
    return _Encoder.wrap(GPT2Model(cfg)), {"input_ids": ids, "attention_mask": mask}, TEXT_AXES


def llama():
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)
    ids, mask = _ids(1000)
    return _Encoder.wrap(LlamaModel(cfg)), {"input_ids": ids, "attention_mask": mask}, TEXT_AXES


# Decode steps: one new token after `past` cached positions. The past keys and values are inputs
# [batch, kv heads, past, head size] and the present ones (past with the new token's appended)
# outputs, as generation runs a decoder step by step; the attention mask covers past and new.
DECODE_DIMS = ({"batch": 2, "past": 8, "total": 9}, {"batch": 1, "past": 17, "total": 18})


class _Decoder:
    """forward(input_ids [B, 1], attention_mask [B, P + 1], past_key_0, past_value_0, ...) ->
    (last_hidden_state, present_key_0, present_value_0, ...) for a transformers decoder, its
    past as a DynamicCache built from the inputs."""

    @staticmethod
    def wrap(model, layers: int):
        import torch
        from transformers import DynamicCache

        class Wrapped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask, *past):
                cache = DynamicCache(config=self.model.config)
                for i in range(layers):
                    cache.update(past[2 * i], past[2 * i + 1], i)
                out = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
                                 use_cache=True)
                present = out.past_key_values
                flat = []
                for i in range(layers):
                    layer = present.layers[i]
                    flat += [layer.keys, layer.values]
                return (out.last_hidden_state, *flat)

        return Wrapped().eval()

    @staticmethod
    def inputs(vocab: int, layers: int, kv_heads: int, head_size: int, batch: int = 2, past: int = 8):
        import torch

        g = torch.Generator().manual_seed(SEED)
        ids = torch.randint(0, vocab, (batch, 1), generator=g)
        mask = torch.ones(batch, past + 1, dtype=torch.int64)
        mask[1, :2] = 0  # a left-padded row, so the export traces the padding mask for real
        feeds = {"input_ids": ids, "attention_mask": mask}
        axes = {"input_ids": {0: "batch"}, "attention_mask": {0: "batch", 1: "total"}}
        for i in range(layers):
            for kind in ("key", "value"):
                name = f"past_{kind}_{i}"
                feeds[name] = torch.randn(batch, kv_heads, past, head_size, generator=g)
                axes[name] = {0: "batch", 2: "past"}
        return feeds, axes

    @staticmethod
    def outputs(layers: int) -> list[str]:
        return ["last_hidden_state"] + [f"present_{k}_{i}" for i in range(layers) for k in ("key", "value")]


def gpt2_decode():
    from transformers import GPT2Config, GPT2Model

    # positions for a past of a few hundred tokens (the benchmark times a past of 128)
    cfg = GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=0,
                     eos_token_id=0)
    feeds, axes = _Decoder.inputs(1000, 2, 4, 16)
    return _Decoder.wrap(GPT2Model(cfg), 2), feeds, axes


def llama_decode():
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512)
    feeds, axes = _Decoder.inputs(1000, 2, 2, 16)
    return _Decoder.wrap(LlamaModel(cfg), 2), feeds, axes


def t5_encoder():
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(vocab_size=1000, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
    # Eager attention: with SDPA, torch.export's decompositions turn the reshape after the
    # transposed attention output into a view it cannot take (ValueError: Cannot view a tensor).
    cfg._attn_implementation = "eager"
    ids, mask = _ids(1000)
    return _Encoder.wrap(T5EncoderModel(cfg)), {"input_ids": ids, "attention_mask": mask}, TEXT_AXES


def whisper_encoder():
    import torch
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    cfg = WhisperConfig(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
                        num_mel_bins=16, max_source_positions=32, vocab_size=100, pad_token_id=0,
                        bos_token_id=0, eos_token_id=0, decoder_start_token_id=0)
    encoder = WhisperEncoder(cfg)

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = encoder

        def forward(self, input_features):
            return self.encoder(input_features).last_hidden_state

    g = torch.Generator().manual_seed(SEED)
    # Whisper's encoder takes exactly 2 * max_source_positions frames: only the batch is symbolic.
    return Wrapped().eval(), {"input_features": torch.randn(2, 16, 64, generator=g)}, {"input_features": {0: "batch"}}


def vit():
    import torch
    from torchvision.models import VisionTransformer

    model = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128,
                              num_classes=10)
    g = torch.Generator().manual_seed(SEED)
    return model.eval(), {"images": torch.randn(2, 3, 32, 32, generator=g)}, {"images": {0: "batch"}}


def _torchvision(factory: str, side: int = 64, **kwargs):
    """A torchvision classifier on side x side images (fixed in the export, as users export them)."""
    def build():
        import torch
        import torchvision.models as tvm

        model = getattr(tvm, factory)(weights=None, **kwargs)
        g = torch.Generator().manual_seed(SEED)
        return model.eval(), {"images": torch.randn(2, 3, side, side, generator=g)}, {"images": {0: "batch"}}

    return build


def _rnn(kind: str, steps: int = 8, input_size: int = 32, hidden: int = 64):
    """A one-layer LSTM or GRU written in torch as nn.LSTMCell/nn.GRUCell compute it, unrolled
    over `steps` time steps, as people write RNN cells by hand. The LSTM splits its gates with
    chunk (Split); the GRU with slices (Slice)."""

    def build():
        import torch
        from torch import nn

        class LSTM(nn.Module):
            def __init__(self):
                super().__init__()
                self.ih = nn.Linear(input_size, 4 * hidden)
                self.hh = nn.Linear(hidden, 4 * hidden)

            def forward(self, x, h, c):
                outs = []
                for t in range(steps):
                    gates = self.ih(x[:, t]) + self.hh(h)
                    i, f, g, o = gates.chunk(4, 1)
                    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                    h = torch.sigmoid(o) * torch.tanh(c)
                    outs.append(h)
                return torch.stack(outs, 1), h, c

        class GRU(nn.Module):
            def __init__(self):
                super().__init__()
                self.ih = nn.Linear(input_size, 3 * hidden)
                self.hh = nn.Linear(hidden, 3 * hidden)

            def forward(self, x, h):
                outs = []
                for t in range(steps):
                    gi = self.ih(x[:, t])
                    gh = self.hh(h)
                    r = torch.sigmoid(gi[:, :hidden] + gh[:, :hidden])
                    z = torch.sigmoid(gi[:, hidden:2 * hidden] + gh[:, hidden:2 * hidden])
                    n = torch.tanh(gi[:, 2 * hidden:] + r * gh[:, 2 * hidden:])
                    h = (1 - z) * n + z * h
                    outs.append(h)
                return torch.stack(outs, 1), h

        g = torch.Generator().manual_seed(SEED)
        x = torch.randn(2, steps, input_size, generator=g)
        h = torch.randn(2, hidden, generator=g)
        axes = {"x": {0: "batch"}, "h0": {0: "batch"}}
        if kind == "lstm":
            c = torch.randn(2, hidden, generator=g)
            return LSTM().eval(), {"x": x, "h0": h, "c0": c}, {**axes, "c0": {0: "batch"}}
        return GRU().eval(), {"x": x, "h0": h}, axes

    return build


CASES = [
    Case("bert", "transformer", "BERT encoder (transformers BertModel), hidden 64, 2 layers, 4 heads, "
         "vocab 1000: padding mask, LayerNorm, erf GELU", bert, ["last_hidden_state"]),
    Case("gpt2", "transformer", "GPT-2 (transformers GPT2Model), hidden 64, 2 layers, 4 heads, vocab 1000: "
         "causal + padding mask, Conv1D projections, tanh GELU", gpt2, ["last_hidden_state"]),
    Case("llama", "transformer", "LLaMA-style decoder (transformers LlamaModel), hidden 64, 2 layers, 4 heads, "
         "2 KV heads: RMSNorm, rotary, grouped-query attention, SiLU-gated MLP", llama, ["last_hidden_state"]),
    Case("gpt2_decode", "transformer", "GPT-2 decode step (transformers GPT2Model), hidden 64, 2 layers, 4 heads: "
         "one new token, past keys/values in, present out, causal + padding mask", gpt2_decode,
         _Decoder.outputs(2), shape_sets=DECODE_DIMS),
    Case("llama_decode", "transformer", "LLaMA-style decode step (transformers LlamaModel), hidden 64, 2 layers, "
         "4 heads, 2 KV heads: one new token, past keys/values in, present out, rotary at the past length",
         llama_decode, _Decoder.outputs(2), shape_sets=DECODE_DIMS),
    Case("t5_encoder", "transformer", "T5 encoder (transformers T5EncoderModel), d_model 64, 2 layers, 4 heads: "
         "relative position buckets, RMS-style T5LayerNorm, ReLU MLP", t5_encoder, ["last_hidden_state"]),
    Case("whisper_encoder", "transformer", "Whisper audio encoder (transformers WhisperEncoder), d_model 64, "
         "2 layers, 16 mel bins, 64 frames: Conv1d + GELU stem, pre-LN attention", whisper_encoder,
         ["last_hidden_state"], shape_sets=IMAGE_DIMS),
    Case("vit", "transformer", "ViT (torchvision VisionTransformer), 32x32 images, patch 8, hidden 64, 2 layers, "
         "4 heads: nn.MultiheadAttention, LayerNorm, GELU", vit, ["logits"], shape_sets=IMAGE_DIMS),
    Case("lstm", "rnn", "LSTM cell written in torch (nn.LSTMCell arithmetic), unrolled over 8 steps, hidden 64: "
         "gate chunk (Split), Sigmoid/Tanh/Mul/Add", _rnn("lstm"), ["outputs", "h", "c"], shape_sets=IMAGE_DIMS),
    Case("gru", "rnn", "GRU cell written in torch (nn.GRUCell arithmetic), unrolled over 8 steps, hidden 64: "
         "gate slices (Slice), Sigmoid/Tanh, (1-z)*n+z*h", _rnn("gru"), ["outputs", "h"], shape_sets=IMAGE_DIMS),
    Case("resnet18", "cnn", "ResNet-18 (torchvision), 64x64 images: Conv+BatchNorm+ReLU, residual Add",
         _torchvision("resnet18"), ["logits"], shape_sets=IMAGE_DIMS),
    Case("mobilenet_v3_small", "cnn", "MobileNetV3-Small (torchvision), 64x64 images: depthwise Conv, "
         "squeeze-excite, Hardswish/Hardsigmoid", _torchvision("mobilenet_v3_small"), ["logits"],
         shape_sets=IMAGE_DIMS),
    Case("efficientnet_b0", "cnn", "EfficientNet-B0 (torchvision), 64x64 images: MBConv, SiLU, squeeze-excite",
         _torchvision("efficientnet_b0"), ["logits"], shape_sets=IMAGE_DIMS),
    Case("shufflenet_v2", "cnn", "ShuffleNetV2 x0.5 (torchvision), 64x64 images: channel split and shuffle "
         "(Split, Reshape/Transpose, Concat)", _torchvision("shufflenet_v2_x0_5"), ["logits"],
         shape_sets=IMAGE_DIMS),
    Case("convnext", "cnn", "ConvNeXt-Tiny (torchvision), 64x64 images: 7x7 depthwise Conv, channels-last "
         "LayerNorm (Permute), GELU, layer scale", _torchvision("convnext_tiny"), ["logits"], shape_sets=IMAGE_DIMS),
]
# The CNNs again at the image size they are built for, 224x224: what their users run, where the
# late layers' maps are 7x7 rather than 2x2 and the early ones 112x112. Tens of milliseconds per
# inference each: the regression suite checks them with the slow tests; the benchmark of record
# times them (bench/cnn224.py).
CNN_224 = [
    ("resnet18", "ResNet-18", "resnet18", "Conv+BatchNorm+ReLU, residual Add"),
    ("mobilenet_v3_small", "MobileNetV3-Small", "mobilenet_v3_small",
     "depthwise Conv, squeeze-excite, Hardswish/Hardsigmoid"),
    ("efficientnet_b0", "EfficientNet-B0", "efficientnet_b0", "MBConv, SiLU, squeeze-excite"),
    ("efficientnet_v2_s", "EfficientNetV2-S", "efficientnet_v2_s", "Fused-MBConv and MBConv, SiLU, squeeze-excite"),
    ("shufflenet_v2", "ShuffleNetV2 x0.5", "shufflenet_v2_x0_5", "channel split and shuffle"),
    ("convnext", "ConvNeXt-Tiny", "convnext_tiny", "7x7 depthwise Conv, channels-last LayerNorm, GELU, layer scale"),
]
CASES += [Case(f"{name}_224", "cnn", f"{title} (torchvision), 224x224 images: {what}", _torchvision(factory, side=224),
               ["logits"], shape_sets=IMAGE_DIMS, slow=True) for name, title, factory, what in CNN_224]


# --------------------------------------------------------------------------- export


@contextlib.contextmanager
def _torchscript_workarounds(model):
    """What the TorchScript exporter needs for these models (see the export notes in
    models/README.md): no MHA fast path, no packed-sequence detection (torch.diff has no
    symbolic; it returns None for unpacked inputs anyway), eager attention for GQA."""
    import torch

    saved_fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    patched = []
    try:
        import transformers.masking_utils as mu

        patched.append((mu, "find_packed_sequence_indices", mu.find_packed_sequence_indices))
        mu.find_packed_sequence_indices = lambda *a, **k: None
    except (ImportError, AttributeError):
        pass
    inner = getattr(model, "model", None)
    config = getattr(inner, "config", None)
    saved_attn = None
    if config is not None and getattr(config, "num_key_value_heads", None) not in (None, config.num_attention_heads):
        saved_attn = config._attn_implementation
        config._attn_implementation = "eager"
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(saved_fastpath)
        for module, attr, value in patched:
            setattr(module, attr, value)
        if saved_attn is not None:
            config._attn_implementation = saved_attn


def export(case: Case, exporter: str) -> onnx.ModelProto:
    import torch

    torch.manual_seed(SEED + zlib.crc32(case.name.encode()) % 10000)
    model, inputs, axes = case.build()
    names = list(inputs)
    args = tuple(inputs[n] for n in names)
    kind, opset = EXPORTERS[exporter]
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if kind == "torchscript":
            has_seq = any("seq" in a.values() for a in axes.values())
            dynamic_axes = dict(axes)
            for out in case.outputs:
                dynamic_axes[out] = {0: "batch", 1: "seq"} if has_seq and out == "last_hidden_state" else {0: "batch"}
                if out.startswith("present_"):
                    dynamic_axes[out] = {0: "batch", 2: "total"}
            with _torchscript_workarounds(model), tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "model.onnx"
                torch.onnx.export(model, args, str(path), dynamo=False, opset_version=opset, input_names=names,
                                  output_names=case.outputs, dynamic_axes=dynamic_axes)
                return onnx.load(str(path)), axes
        dims = {}
        if any("past" in a.values() for a in axes.values()):
            # a decode step: the mask covers the past and the new token, a dim derived from past's
            dims["past"] = torch.export.Dim("past", min=1, max=1024)
            dims["total"] = dims["past"] + 1
        shapes = tuple({axis: dims.setdefault(d, torch.export.Dim(d, min=1, max=64 if d == "seq" else 1024))
                        for axis, d in axes[n].items()} if n in axes else None for n in names)
        import inspect

        fixed = [p for p in inspect.signature(model.forward).parameters.values() if p.kind != p.VAR_POSITIONAL]
        if len(fixed) < len(shapes):  # forward(a, b, *rest): the spec mirrors it (export notes, 1.)
            shapes = (*shapes[:len(fixed)], shapes[len(fixed):])
        program = torch.onnx.export(model, args, dynamo=True, opset_version=opset, input_names=names,
                                    output_names=case.outputs, dynamic_shapes=shapes)
        return program.model_proto, axes


def _value_info(value: onnx.ValueInfoProto) -> tuple[str, str, list]:
    t = value.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim]
    return value.name, onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name, dims


def manifest_entry(case: Case, exporter: str, model: onnx.ModelProto, name: str) -> dict:
    kind, opset = EXPORTERS[exporter]
    initializers = {t.name for t in model.graph.initializer}
    inputs = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        iname, dtype, dims = _value_info(value)
        entry = {"name": iname, "dtype": dtype, "shape": dims}
        if iname in case.input_notes:
            entry["description"] = case.input_notes[iname]
        inputs.append(entry)
    symbolic = {d for i in inputs for d in i["shape"] if isinstance(d, str)}
    sets = [{k: v for k, v in s.items() if k in symbolic} for s in case.shape_sets]
    entry = {
        "name": name,
        "source": "corpus",
        "file": f"corpus/{name}.onnx",
        "generator": "corpus/build.py",
        "exporter": kind,
        "family": case.family,
        "description": f"{case.description} [torch.onnx {kind} exporter, opset {opset}]",
        "inputs": inputs,
    }
    if symbolic:
        entry["dims"] = sets[0]
        entry["alt_dims"] = sets[1:]
    if case.slow:
        entry["slow"] = True
    return entry


def write_manifest(entries: dict[str, dict]) -> None:
    path = MODELS / MANIFEST
    doc = json.loads(path.read_text())
    # an entry rebuilt keeps its place; new ones go to the end
    known = {m["name"] for m in doc["models"]}
    doc["models"] = [entries.get(m["name"], m) for m in doc["models"]] + [e for n, e in entries.items() if n not in known]
    path.write_text(json.dumps(doc, indent=2) + "\n")


def _rename_dims(model: onnx.ModelProto, case_axes: dict) -> None:
    """Give the graph inputs' and outputs' symbolic dims the corpus names (batch, seq) when an
    exporter named them itself (s0, s1, ...)."""
    renames = {}
    for value in model.graph.input:
        for axis, name in case_axes.get(value.name, {}).items():
            dim = value.type.tensor_type.shape.dim[axis]
            if dim.HasField("dim_param") and dim.dim_param != name:
                renames[dim.dim_param] = name
    if not renames:
        return
    for value in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        if value.type.HasField("tensor_type"):
            for dim in value.type.tensor_type.shape.dim:
                if dim.HasField("dim_param") and dim.dim_param in renames:
                    dim.dim_param = renames[dim.dim_param]


def _drop_debug_metadata(model: onnx.ModelProto) -> None:
    """The dynamo exporter annotates every node with its Python stack trace, module path and FX
    node; that is most of a small model's bytes and nothing a graph optimizer reads."""
    for node in model.graph.node:
        del node.metadata_props[:]
    for value in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        del value.metadata_props[:]
    for tensor in model.graph.initializer:
        del tensor.metadata_props[:]


@click.command(help=__doc__.split("\n\n")[0])
@click.argument("names", nargs=-1)
@click.option("--exporter", "exporters", multiple=True, type=click.Choice(sorted(EXPORTERS)),
              help="only this exporter (repeatable; default both)")
@click.option("--list", "list_only", is_flag=True, help="list the architectures and exit")
def main(names, exporters, list_only):
    if list_only:
        for case in CASES:
            click.echo(f"{case.name:20s} {case.family:12s} {case.description}")
        return
    known = {c.name: c for c in CASES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise click.BadParameter(f"unknown architecture(s) {', '.join(unknown)}; known: {', '.join(known)}")
    chosen = [known[n] for n in names] if names else CASES
    entries: dict[str, dict] = {}
    failed = []
    for case in chosen:
        for exporter in exporters or EXPORTERS:
            name = f"{case.name}_{exporter}"
            try:
                model, axes = export(case, exporter)
                _rename_dims(model, axes)
            except Exception as e:  # one architecture failing to export must not stop the others
                failed.append(name)
                click.echo(f"{name:28s} export failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", err=True)
                continue
            _drop_debug_metadata(model)
            stripped = strip_weights(model, seed=zlib.crc32(name.encode()) & 0x7FFFFFFF)
            data = model.SerializeToString()
            (HERE / f"{name}.onnx").write_bytes(data)
            entries[name] = manifest_entry(case, exporter, model, name)
            click.echo(f"{name:28s} {len(model.graph.node):5d} nodes  {stripped:4d} seeded tensors  "
                       f"{len(data) / 1024:8.1f} KiB", err=True)
    if entries:
        write_manifest(entries)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
