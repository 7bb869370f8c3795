"""Convert a llama-architecture GGUF file into an mlx-lm model directory.

MLX reads GGUF itself (`mx.load`): Q4_0/Q4_1/Q8_0 tensors arrive in MLX's affine
layout (group 32), so the converted directory keeps them quantized, bit for bit.
What MLX does not do is undo llama.cpp's conversion choices, so this module:

- renames tensors to the Hugging Face / mlx-lm names;
- undoes the row permutation llama.cpp applies to attn_q/attn_k (its rotary layout
  interleaves the two rotary halves; mlx-lm's llama expects them split). Rows are
  quantized independently (groups run along the input dimension), so permuting the
  packed rows, scales and biases is exact;
- writes config.json, tokenizer.json (byte-level BPE from the GGUF vocab and merges)
  and tokenizer_config.json (with the GGUF's chat template).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import mlx.core as mx

ProgressFactory = Callable[..., object]

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# GGUF quantization types that mx.load turns into MLX affine tensors (group 32).
_GGUF_BITS = {2: 4, 3: 4, 7: 8}  # general.file_type: Q4_0, Q4_1, Q8_0


class GGUFError(ValueError):
    """The file is not a GGUF this converter understands."""


def _scalar(meta: dict, key: str, default=None):
    value = meta.get(key, default)
    if value is None:
        raise GGUFError(f"GGUF metadata lacks {key}")
    return value.item() if hasattr(value, "item") else value


def hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")  # suffix: weight / scales / biases
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part not in _LAYER_NAMES:
            raise GGUFError(f"unknown GGUF tensor {gguf_name}")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    if base not in _TOP_NAMES:
        raise GGUFError(f"unknown GGUF tensor {gguf_name}")
    return f"{_TOP_NAMES[base]}.{suffix}"


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Inverse of llama.cpp's `permute` for q/k projections (acts on rows only)."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def model_config(meta: dict) -> dict:
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise GGUFError(f"only llama-architecture GGUF files are supported, not {arch}")
    p = "llama."
    hidden = int(_scalar(meta, p + "embedding_length"))
    heads = int(_scalar(meta, p + "attention.head_count"))
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(meta, p + "block_count")),
        "intermediate_size": int(_scalar(meta, p + "feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(meta, p + "attention.head_count_kv", heads)),
        "head_dim": int(_scalar(meta, p + "rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(_scalar(meta, p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_scalar(meta, p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_scalar(meta, p + "context_length")),
        "vocab_size": int(_scalar(meta, p + "vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id")),
    }
    file_type = int(_scalar(meta, "general.file_type", 0))
    if file_type in _GGUF_BITS:
        config["quantization"] = {"group_size": 32, "bits": _GGUF_BITS[file_type], "mode": "affine"}
    return config


def write_tokenizer(meta: dict, out: Path) -> None:
    """tokenizer.json and tokenizer_config.json from the GGUF's gpt2-style BPE vocab."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if _scalar(meta, "tokenizer.ggml.model") != "gpt2":
        raise GGUFError("only byte-level BPE (gpt2) GGUF tokenizers are supported")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = meta["tokenizer.ggml.token_type"].tolist()
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # llama.cpp's "smollm"/"starcoder" pre-tokenizers split every digit on its own first.
    if meta.get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact"):
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    # token_type 3 = control tokens: never split by BPE, skipped when decoding.
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3]
    )
    tok.save(str(out / "tokenizer.json"))

    def token(key):
        idx = meta.get(key)
        return tokens[int(idx.item())] if idx is not None else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta, "llama.context_length")),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def convert_gguf(gguf_path: Path, out: Path, progress: ProgressFactory | None = None) -> dict:
    """Write an mlx-lm model directory for `gguf_path` into `out`; returns the config."""
    try:
        weights, meta = mx.load(str(gguf_path), return_metadata=True)
    except Exception as exc:  # mx.load raises RuntimeError/ValueError on bad files
        raise GGUFError(f"cannot read {gguf_path} as GGUF: {' '.join(str(exc).split())}") from exc
    config = model_config(meta)
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(weights)
    bar = progress(total=len(names), desc="convert", unit="tensor") if progress else None
    converted = {}
    for name in names:
        w = weights[name]
        if ".attn_q." in name:
            w = unpermute_rows(w, config["num_attention_heads"])
        elif ".attn_k." in name:
            w = unpermute_rows(w, config["num_key_value_heads"])
        converted[hf_name(name)] = w
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    config["tie_word_embeddings"] = "lm_head.weight" not in converted
    mx.save_safetensors(str(out / "model.safetensors"), converted, metadata={"format": "mlx"})
    write_tokenizer(meta, out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return config
