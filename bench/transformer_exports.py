"""Small transformers exported with both torch.onnx exporters, for bench/onnxscript_fusions.py.

Needs torch and transformers (bench only; neither CI nor the tests use this). Architectures at
small configs (hidden 64, 2 layers, 4 heads; LLaMA with 2 KV heads), weights seeded and
perturbed (torch.manual_seed(0), + 0.02 N(0, 1)) so that no two biases are equal, batch 2,
sequence 16, static shapes. TorchScript exporter (dynamo=False) at opset 17, torch.export-based
exporter (dynamo=True) at opset 18, with the workarounds in the module's comments.

    python -m bench.transformer_exports OUT_DIR [NAME ...]
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import click

from bench import harness


def models():
    from transformers import (BertConfig, BertModel, GPT2Config, GPT2Model, LlamaConfig, LlamaModel, T5Config,
                              T5EncoderModel, ViTConfig, ViTModel, Wav2Vec2Config, Wav2Vec2Model, WhisperConfig)
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    yield "bert", BertModel(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=128, vocab_size=1000, max_position_embeddings=128)), "ids"
    yield "gpt2", GPT2Model(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=128)), "ids"
    yield "llama", LlamaModel(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=128, vocab_size=1000,
                                          max_position_embeddings=128)), "ids"
    yield "vit", ViTModel(ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=128, image_size=32, patch_size=8), add_pooling_layer=False), "pixels"
    yield "wav2vec2", Wav2Vec2Model(Wav2Vec2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, conv_dim=(32, 32),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        do_stable_layer_norm=True, feat_extract_norm="layer")), "audio"
    yield "t5enc", T5EncoderModel(T5Config(d_model=64, d_kv=16, num_layers=2, num_heads=4, d_ff=128,
                                           vocab_size=1000)), "ids"
    yield "whisper", WhisperEncoder(WhisperConfig(d_model=64, encoder_layers=2, encoder_attention_heads=4,
                                                  encoder_ffn_dim=128, num_mel_bins=16,
                                                  max_source_positions=32)), "mel"


@click.command(help=__doc__.split("\n\n")[0] + "\n\nOUT_DIR: where the models go; NAMES: only these (default: all).")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.argument("names", nargs=-1)
def cli(out_dir: Path, names: tuple[str, ...]) -> int:
    import torch
    import transformers.masking_utils as masking_utils

    warnings.filterwarnings("ignore")
    only = set(names)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    batch, seq = 2, 16

    class LastHidden(torch.nn.Module):
        def __init__(self, m, no_cache: bool):
            super().__init__()
            self.m, self.no_cache = m, no_cache

        def forward(self, *a):
            if len(a) == 2:  # keywords: a decoder's second positional parameter is its cache
                kw = {"use_cache": False} if self.no_cache else {}
                return self.m(input_ids=a[0], attention_mask=a[1], **kw).last_hidden_state
            return self.m(*a).last_hidden_state

    for name, m, kind in models():
        if only and name not in only:
            continue
        m.eval()
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        if name == "llama":
            # The TorchScript exporter's SDPA symbolic rejects enable_gqa: the eager attention
            # writes repeat_kv out instead.
            m.config._attn_implementation = "eager"
        w = LastHidden(m, name in ("gpt2", "llama")).eval()
        if kind == "ids":
            args = (torch.randint(0, 1000, (batch, seq)), torch.ones(batch, seq, dtype=torch.int64))
            names = ["input_ids", "attention_mask"]
        elif kind == "pixels":
            args, names = (torch.randn(batch, 3, 32, 32),), ["pixel_values"]
        elif kind == "audio":
            args, names = (torch.randn(batch, 1600),), ["input_values"]
        else:
            args, names = (torch.randn(batch, 16, 64),), ["input_features"]
        for dynamo in (False, True):
            out = out_dir / f"{name}_{'dynamo' if dynamo else 'ts'}.onnx"
            with torch.no_grad():
                if dynamo:
                    torch.onnx.export(w, args, str(out), input_names=names, output_names=["out"], opset_version=18,
                                      dynamo=True, external_data=False)
                    continue
                # TorchScript: find_packed_sequence_indices uses torch.diff (no symbolic) and returns
                # None for unpacked position ids; torchvision-style MHA fast path has no symbolic.
                packed = masking_utils.find_packed_sequence_indices
                masking_utils.find_packed_sequence_indices = lambda *a, **k: None
                torch.backends.mha.set_fastpath_enabled(False)
                try:
                    torch.onnx.export(w, args, str(out), input_names=names, output_names=["out"], opset_version=17,
                                      dynamo=False)
                finally:
                    masking_utils.find_packed_sequence_indices = packed
            print("wrote", out, flush=True)
    return 0


main = harness.main_of(cli)

if __name__ == "__main__":
    sys.exit(main())
