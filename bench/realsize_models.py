"""Real-size models for bench/realsize.py, generated from torch / transformers / torchvision.

Needs torch, torchvision and transformers (the benchmark runs this module with a Python that has
them: --torch-python); neither CI nor the tests use it. Each model is the published architecture
at its published configuration with random weights (torch.manual_seed(0)), exported at float32:

    bert_ts          BERT-base (BertModel), TorchScript exporter, opset 17, batch x seq dynamic
    bert_dynamo      the same, torch.export-based exporter, opset 18, dynamic shapes
    gpt2_ts          GPT-2 small (GPT2LMHeadModel, no cache), TorchScript, batch x seq dynamic
    gpt2_decode_ts   GPT-2 small, one decode step: input_ids [batch, 1], 12 x (key, value)
                     [batch, 12, past, 64], attention_mask [batch, past + 1]; TorchScript
    vit_ts           ViT-B/16 at 224 (ViTModel), TorchScript, batch dynamic
    resnet50_ts      torchvision ResNet-50, TorchScript, batch dynamic
    whisper_enc_ts   Whisper-base encoder (80 mel bins, 3000 frames), TorchScript, batch dynamic
    qwen2_decode_ts  Qwen2-0.5B, one decode step with past, TorchScript, weights as external data
    tinyllama_decode_ts  TinyLlama-1.1B (LLaMA: 22 layers, 32 query and 4 key/value heads), one
                     decode step with past, TorchScript, weights as external data

    python bench/realsize_models.py OUT_DIR [NAME ...]
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

NAMES = ("bert_ts", "bert_dynamo", "gpt2_ts", "gpt2_decode_ts", "vit_ts", "resnet50_ts", "whisper_enc_ts",
         "qwen2_decode_ts", "tinyllama_decode_ts")
EXTERNAL = {"qwen2_decode_ts", "tinyllama_decode_ts"}  # weights in OUT.data (over protobuf's 2 GB)


def _no_packed_sequence():
    # TorchScript: find_packed_sequence_indices uses torch.diff (no symbolic).
    import transformers.masking_utils as masking_utils

    masking_utils.find_packed_sequence_indices = lambda *a, **k: None


def _whole_sequence(model, vocab: int, seq: int, pick, **call):
    """(module, args, input names, dynamic axes) for `model` over a whole sequence of token ids
    with its attention mask, its output `pick(model(...))`."""
    import torch

    class Wrap(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask):
            return pick(self.m(input_ids=input_ids, attention_mask=attention_mask, **call))

    args = (torch.randint(0, vocab, (1, seq)), torch.ones(1, seq, dtype=torch.int64))
    names = ["input_ids", "attention_mask"]
    axes = {n: {0: "batch", 1: "sequence"} for n in names}
    axes["out"] = {0: "batch", 1: "sequence"}
    return Wrap(model), args, names, axes


def _decoder_step(model, layers: int, kv_heads: int, head_dim: int, past: int):
    """(module, args, input names, dynamic axes) for one decode step with a cache of `past`."""
    import torch
    from transformers import DynamicCache

    class Step(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, *kv):
            cache = DynamicCache(config=self.m.config)
            for i in range(layers):
                cache.update(kv[2 * i], kv[2 * i + 1], i)
            out = self.m(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
            present = []
            for layer in out.past_key_values.layers:
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    batch = 1
    kv = []
    names = ["input_ids", "attention_mask"]
    axes = {"input_ids": {0: "batch"}, "attention_mask": {0: "batch", 1: "total_sequence"}}
    for i in range(layers):
        for kind in ("key", "value"):
            kv.append(torch.randn(batch, kv_heads, past, head_dim))
            name = f"past_key_values.{i}.{kind}"
            names.append(name)
            axes[name] = {0: "batch", 2: "past_sequence"}
    args = (torch.randint(0, 1000, (batch, 1)), torch.ones(batch, past + 1, dtype=torch.int64), *kv)
    out_names = ["logits"] + [f"present.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    for name in out_names[1:]:
        axes[name] = {0: "batch", 2: "total_sequence"}
    axes["logits"] = {0: "batch"}
    return Step(model), args, names, out_names, axes


def build(name: str, out: Path) -> None:
    import torch
    import transformers

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    torch.backends.mha.set_fastpath_enabled(False)
    _no_packed_sequence()
    seq = 128
    dynamo = name.endswith("_dynamo")
    out_names = ["out"]
    if name in ("bert_ts", "bert_dynamo"):
        m = transformers.BertModel(transformers.BertConfig(), add_pooling_layer=False)
        module, args, names, axes = _whole_sequence(m, 30522, seq, lambda o: o.last_hidden_state)
    elif name == "gpt2_ts":
        m = transformers.GPT2LMHeadModel(transformers.GPT2Config())
        module, args, names, axes = _whole_sequence(m, 50257, seq, lambda o: o.logits, use_cache=False)
    elif name == "gpt2_decode_ts":
        cfg = transformers.GPT2Config()
        m = transformers.GPT2LMHeadModel(cfg)
        module, args, names, out_names, axes = _decoder_step(m, cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, seq)
    elif name == "qwen2_decode_ts":
        cfg = transformers.Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                       num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                       max_position_embeddings=32768, tie_word_embeddings=True)
        cfg._attn_implementation = "eager"
        m = transformers.Qwen2ForCausalLM(cfg)
        module, args, names, out_names, axes = _decoder_step(m, 24, 2, 64, seq)
    elif name == "tinyllama_decode_ts":
        cfg = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                       num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                                       max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0)
        cfg._attn_implementation = "eager"
        m = transformers.LlamaForCausalLM(cfg)
        module, args, names, out_names, axes = _decoder_step(m, 22, 4, 64, seq)
    elif name == "vit_ts":
        m = transformers.ViTModel(transformers.ViTConfig(), add_pooling_layer=False)

        class Wrap(torch.nn.Module):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, pixel_values):
                return self.m(pixel_values=pixel_values).last_hidden_state

        module, args, names = Wrap(m), (torch.randn(1, 3, 224, 224),), ["pixel_values"]
        axes = {"pixel_values": {0: "batch"}, "out": {0: "batch"}}
    elif name == "resnet50_ts":
        import torchvision

        module, args, names = torchvision.models.resnet50(weights=None), (torch.randn(1, 3, 224, 224),), ["images"]
        axes = {"images": {0: "batch"}, "out": {0: "batch"}}
    elif name == "whisper_enc_ts":
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        cfg = transformers.WhisperConfig(d_model=512, encoder_layers=6, encoder_attention_heads=8,
                                         encoder_ffn_dim=2048, num_mel_bins=80, max_source_positions=1500)
        enc = WhisperEncoder(cfg)

        class Wrap(torch.nn.Module):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, input_features):
                return self.m(input_features).last_hidden_state

        module, args, names = Wrap(enc), (torch.randn(1, 80, 3000),), ["input_features"]
        axes = {"input_features": {0: "batch"}, "out": {0: "batch"}}
    else:
        raise SystemExit(f"unknown model {name}; known: {', '.join(NAMES)}")
    module.eval()
    with torch.no_grad():
        if dynamo:
            batch = torch.export.Dim("batch", min=1, max=64)
            sequence = torch.export.Dim("sequence", min=2, max=512)
            shapes = {n: {0: batch, 1: sequence} for n in names}
            torch.onnx.export(module, args, str(out), input_names=names, output_names=out_names, opset_version=18,
                              dynamo=True, external_data=False, dynamic_shapes=shapes)
        else:
            torch.onnx.export(module, args, str(out), input_names=names, output_names=out_names, opset_version=17,
                              dynamo=False, dynamic_axes=axes)
    if name in EXTERNAL:
        import onnx

        model = onnx.load(str(out))
        onnx.save(model, str(out), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=out.name + ".data", size_threshold=1024)


def main(argv: list[str]) -> int:
    out_dir = Path(argv[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in argv[1:] or NAMES:
        out = out_dir / f"{name}.onnx"
        build(name, out)
        print("wrote", out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
