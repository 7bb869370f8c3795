"""Encoder embedding models (BERT, RoBERTa, XLM-RoBERTa): the sentence-transformers models
RAG tools use, such as all-MiniLM-L6-v2, multilingual-e5 or bge-m3, in MLX.

mlx-lm has only decoders, and the MLX library that has encoders (mlx-embeddings) brings
mlx-vlm, and with it OpenCV, datasets and a second web framework; the encoder itself is
one small module. Its parameters carry Hugging Face's names, so a checkpoint's
`model.safetensors` loads as it is (a `bert.` / `roberta.` prefix and the pooler dropped).

Attention is bidirectional, so a batch's padding is masked out of every key; positions are
absolute (RoBERTa's count from the padding id + 1). A model loaded here serves embeddings
only (engine/embed.py pools its states).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger("lmsp_mlx.engine")

# model_type -> where positions start: BERT at 0; RoBERTa's after its padding id
ENCODER_TYPES = {"bert": "absolute", "roberta": "after_padding", "xlm-roberta": "after_padding"}


def _first_position(cfg: dict) -> int:
    """Where positions start: 0, or RoBERTa's padding id + 1."""
    return cfg.get("pad_token_id", 1) + 1 if ENCODER_TYPES[cfg["model_type"]] == "after_padding" else 0


class _Embeddings(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], cfg["hidden_size"])
        self.token_type_embeddings = nn.Embedding(cfg.get("type_vocab_size", 2), cfg["hidden_size"])
        self.LayerNorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg.get("layer_norm_eps", 1e-12))

    def __call__(self, tokens: mx.array, positions: mx.array) -> mx.array:
        h = self.word_embeddings(tokens) + self.position_embeddings(positions)
        return self.LayerNorm(h + self.token_type_embeddings(mx.zeros_like(tokens)))


class _SelfAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)


class _Dense(nn.Module):
    """A projection, then the residual and LayerNorm (BERT's `*.output` blocks)."""

    def __init__(self, cfg: dict, inner: int) -> None:
        super().__init__()
        self.dense = nn.Linear(inner, cfg["hidden_size"])
        self.LayerNorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg.get("layer_norm_eps", 1e-12))

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.heads = cfg["num_attention_heads"]
        self.self = _SelfAttention(cfg["hidden_size"])
        self.output = _Dense(cfg, cfg["hidden_size"])

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        b, n, d = x.shape
        split = lambda t: t.reshape(b, n, self.heads, -1).transpose(0, 2, 1, 3)  # noqa: E731
        q, k, v = split(self.self.query(x)), split(self.self.key(x)), split(self.self.value(x))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask=mask)
        return self.output(out.transpose(0, 2, 1, 3).reshape(b, n, d), x)


class _Intermediate(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg["hidden_size"], cfg["intermediate_size"])

    def __call__(self, x: mx.array) -> mx.array:
        return nn.gelu(self.dense(x))  # BERT's "gelu": the exact (erf) one


class _Layer(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.attention = _Attention(cfg)
        self.intermediate = _Intermediate(cfg)
        self.output = _Dense(cfg, cfg["intermediate_size"])

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        h = self.attention(x, mask)
        return self.output(self.intermediate(h), h)


class _Stack(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.layer = [_Layer(cfg) for _ in range(cfg["num_hidden_layers"])]


class Encoder(nn.Module):
    """BERT's encoder: `__call__(tokens (B, L), lengths (B,))` gives the last layer's
    states (B, L, dim); a row's positions past its length are padding, masked out."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        act = cfg.get("hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"hidden_act {act!r} (only BERT's gelu is built)")
        self.embeddings = _Embeddings(cfg)
        self.encoder = _Stack(cfg)
        self.first_position = _first_position(cfg)

    def __call__(self, tokens: mx.array, lengths: mx.array) -> mx.array:
        real = mx.arange(tokens.shape[1])[None, :] < lengths[:, None]  # (B, L)
        positions = mx.broadcast_to(mx.arange(tokens.shape[1]) + self.first_position, tokens.shape)
        mask = mx.where(real, 0.0, -mx.inf)[:, None, None, :].astype(mx.float32)  # every query, no padded key
        h = self.embeddings(tokens, positions)
        for layer in self.encoder.layer:
            h = layer(h, mask)
        return h


def load_encoder_weights(path: Path, cfg: dict) -> Encoder:
    """The encoder of `path` in float32, from its safetensors under Hugging Face's names."""
    model = Encoder(cfg)
    weights = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    prefix = next((p for p in ("bert.", "roberta.", "model.") if any(k.startswith(p) for k in weights)), "")
    weights = {k[len(prefix):]: v.astype(mx.float32) for k, v in weights.items() if k.startswith(prefix)}
    weights = {k: v for k, v in weights.items() if not k.startswith("pooler.") and not k.endswith("position_ids")}
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def encoder_context(path: Path, cfg: dict) -> int:
    """The longest input: sentence-transformers' `max_seq_length` where stated (what the model
    was trained and is used with), else the positions it has (RoBERTa's less its offset)."""
    positions = cfg["max_position_embeddings"] - _first_position(cfg)
    st = path / "sentence_bert_config.json"
    if st.is_file():
        stated = json.loads(st.read_text()).get("max_seq_length")
        if isinstance(stated, int) and 0 < stated <= positions:
            return stated
    return positions
