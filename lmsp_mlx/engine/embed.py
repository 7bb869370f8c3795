"""Embeddings: one vector per input, pooled from the model body's last hidden states.

Three kinds of model embed:
- an encoder (BERT, RoBERTa, XLM-RoBERTa: engine/encoder.py), as its sentence-transformers
  layout says (all-MiniLM-L6-v2: mean, normalised), else mean, normalised;
- a dedicated embedding model: a checkpoint in the sentence-transformers layout says how it
  pools (`1_Pooling/config.json`) and whether it normalises (a `Normalize` module in
  `modules.json`). Qwen3-Embedding is one: mlx-lm's qwen3 body, the last token's state,
  normalised. Such a model serves embeddings only.
- any served language model: its body's states averaged over the input's tokens, then
  L2-normalised (`LM_POOLING`). This is what llama-server and Ollama give for a chat model;
  it is good for similarity between texts, not a trained retrieval embedding.

Inputs of a batch are padded on the right: a decoder's real token never attends to the
padding after it, and an encoder masks it out, so each input's vector is what it would be
alone.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import mlx.core as mx
import mlx.nn as nn

from .encoder import Encoder

log = logging.getLogger("lmsp_mlx.engine")

Pooling = Literal["mean", "last", "cls"]


@dataclass(frozen=True)
class EmbeddingSpec:
    pooling: Pooling
    normalize: bool


LM_POOLING = EmbeddingSpec("mean", normalize=True)  # a language model's, where it states none


def embedding_spec(path: Path) -> EmbeddingSpec | None:
    """The pooling a sentence-transformers checkpoint states, or None for a plain language model."""
    pooling = path / "1_Pooling" / "config.json"
    if not pooling.is_file():
        return None
    cfg = json.loads(pooling.read_text())
    mode: Pooling = "last" if cfg.get("pooling_mode_lasttoken") else "cls" if cfg.get("pooling_mode_cls_token") \
        else "mean"
    modules = path / "modules.json"
    normalize = modules.is_file() and any("Normalize" in str(m.get("type", "")) for m in json.loads(modules.read_text()))
    return EmbeddingSpec(mode, normalize)


# Where mlx-lm's models keep their body (embeddings and layers, the final norm, no head):
# most at `model`; a multimodal checkpoint's text model under `language_model` (Qwen3.5);
# Nemotron-H at `backbone`.
BODY_PATHS = (("model",), ("language_model", "model"), ("backbone",))


def body_of(model: nn.Module) -> nn.Module:
    """The model's body, by the paths mlx-lm's models use; a model with none cannot embed."""
    for path in BODY_PATHS:
        node = model
        for key in path:
            node = node.get(key) if isinstance(node, nn.Module) else None
        if isinstance(node, nn.Module):
            return node
    raise ValueError(f"{type(model).__module__} keeps its body where embeddings cannot find it")


def states_of(model: nn.Module) -> Callable[[mx.array, mx.array], mx.array]:
    """`(tokens (B, L), lengths (B,)) -> states (B, L, dim)` for a batch padded on the right:
    an encoder masks the padding out of its attention; a decoder's causal attention already
    keeps a real token from the padding after it."""
    if isinstance(model, Encoder):
        return model
    body = body_of(model)
    return lambda tokens, lengths: body(tokens)


def batches(inputs: list[list[int]], budget: int) -> list[list[int]]:
    """Indices of `inputs` grouped for one forward each, similar lengths together, each
    within `budget` tokens once padded (a longer input goes alone: `Chunked`)."""
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
    out: list[list[int]] = []
    for i in order:
        if out and len(inputs[i]) * (len(out[-1]) + 1) <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class Chunked:
    """One long input through a decoder's body a chunk at a time, over a cache of its own:
    causal attention makes each chunk's states what one forward gives, so pooling them as
    they come gives the same vector, and each chunk can run in a call of its own (the
    worker's decode steps go on between them)."""

    def __init__(self, model: nn.Module, tokens: list[int], spec: EmbeddingSpec) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.body, self.cache = body_of(model), make_prompt_cache(model)
        self.tokens, self.spec, self.at = tokens, spec, 0
        self.total: mx.array | None = None
        self.first: mx.array | None = None
        self.last: mx.array | None = None

    @property
    def done(self) -> bool:
        return self.at >= len(self.tokens)

    def step(self, n: int) -> None:
        part = self.tokens[self.at:self.at + n]
        h = self.body(mx.array([part]), cache=self.cache)[0].astype(mx.float32)
        self.total = h.sum(axis=0) if self.total is None else self.total + h.sum(axis=0)
        self.first = h[0] if self.first is None else self.first
        self.last = h[-1]
        mx.eval(self.total, self.first, self.last, [c.state for c in self.cache])
        self.at += len(part)

    def vector(self) -> list[float]:
        pooled = {"mean": self.total / len(self.tokens), "last": self.last, "cls": self.first}[self.spec.pooling]
        if self.spec.normalize:
            pooled = pooled / mx.maximum(mx.linalg.norm(pooled), 1e-12)
        return pooled.tolist()


def embed(states_fn, inputs: list[list[int]], spec: EmbeddingSpec) -> list[list[float]]:
    """One vector per input from one forward (`states_of`), pooled as `spec` says."""
    longest = max(len(t) for t in inputs)
    padded = mx.array([t + [0] * (longest - len(t)) for t in inputs])
    lengths = mx.array([len(t) for t in inputs])
    states = states_fn(padded, lengths).astype(mx.float32)
    if spec.pooling == "mean":
        mask = (mx.arange(longest)[None, :] < lengths[:, None]).astype(mx.float32)[..., None]
        pooled = (states * mask).sum(axis=1) / lengths[:, None].astype(mx.float32)
    elif spec.pooling == "last":
        pooled = mx.take_along_axis(states, (lengths - 1)[:, None, None], axis=1)[:, 0, :]
    else:
        pooled = states[:, 0, :]
    if spec.normalize:
        pooled = pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
    return pooled.tolist()
