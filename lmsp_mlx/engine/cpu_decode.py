"""Decode steps of llama-family float32 models in one compiled call, on MLX's CPU backend.

A decode step through MLX is a few hundred small dispatches around one-row products; on
the Linux CPU build that left decode at a third of the memory-bandwidth bound. The
compiled `lmsp_decode_step` (cpu_blas/decode.c, its own extension) runs the whole step, the
output head included, reading MLX's weight arrays and writing the new position's K/V straight into the
layers' mlx-lm `KVCache` buffers, whose offsets are then advanced as `update_and_fetch`
would.

`decode_steps(model)` binds it to a model as two steps, which the compiled CPU runner
(engine/runners.py) calls: `DecodeStep`, one token against plain `KVCache`s (grown first
where they are full, as MLX grows them; MLX runs anything else: prefill, sliding-window
caches), and `BatchStep`, one token for each of several sequences, each on its own cache
(plain, or quantized as below), in one pass over the weights (the worker's batched
decode steps).
`--kv-bits` caches (`QuantizedKVCache`, float32 scales) take it too: the step quantizes
the new K/V row as `mx.quantize` does and runs attention.c's attention over the cache
inside its own thread team (through MLX such a step ran op by op, 3x slower than a plain
cache's). Like attention.c elsewhere, that follows LMSP_KERNELS: under `reference` or
`off` a quantized cache's steps (and, in cpu_prefill, its prompt chunks) go through MLX.
Models it does not recognise (not llama/qwen2 layouts, quantized or half weights, rope
scaling other than plain) are left alone. `LMSP_CPU_DECODE=0` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .. import cpu_blas
from ..kernels import mode as kernel_mode
from .cpu_math import FusedRoPE, _rope_tables

log = logging.getLogger("lmsp_mlx.engine")

P = ctypes.POINTER(ctypes.c_float)
W = ctypes.POINTER(ctypes.c_uint32)
# A quantized cache's six parts, in the order of (*cache.keys, *cache.values).
CODES = ("key_codes", "key_scales", "key_biases", "value_codes", "value_scales", "value_biases")


class _Layer(ctypes.Structure):
    _fields_ = [(name, P) for name in (
        "attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "wgate", "wup", "wdown", "bq", "bk", "bv", "keys", "values")] + [
        ("key_codes", W), ("value_codes", W)] + [
        (name, P) for name in ("key_scales", "key_biases", "value_scales", "value_biases")]


class _Cache(ctypes.Structure):  # model.h's lmsp_cache: one sequence's cache of one layer
    _fields_ = [("keys", P), ("values", P), ("key_codes", W), ("value_codes", W)] + [
        (name, P) for name in ("key_scales", "key_biases", "value_scales", "value_biases")]


class _Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in (
        "n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "hidden", "vocab", "capacity", "rope_dims")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("embed", P), ("final_norm", P), ("head", P),
        ("layers", ctypes.POINTER(_Layer)), ("kv_bits", ctypes.c_int32), ("kv_group", ctypes.c_int32)]


def _ptr(a: np.ndarray | None):
    return ctypes.cast(a.ctypes.data, P) if a is not None else None


def _view(a: mx.array, dtype=mx.float32) -> np.ndarray | None:
    """A zero-copy view of an evaluated MLX array of `dtype`, if it is contiguous."""
    if a.dtype != dtype:
        return None
    view = np.asarray(a)
    return view if view.flags["C_CONTIGUOUS"] else None


class CompiledModel:
    """A model's weights as the compiled passes' `lmsp_model` (cpu_blas/model.h): pointers
    into MLX's own buffers, kept alive by views held here."""

    def __init__(self, model: nn.Module, body: nn.Module, rope: nn.RoPE) -> None:
        first = body.layers[0]
        attn = first.self_attn
        self.views: list[np.ndarray] = []

        def weight(a: mx.array | None) -> np.ndarray | None:
            if a is None:
                return None
            view = _view(a)
            if view is None:
                raise ValueError("a weight is not a contiguous float32 array")
            self.views.append(view)
            return view

        layers = (_Layer * len(body.layers))()
        for layer, spec in zip(body.layers, layers):
            a, mlp = layer.self_attn, layer.mlp
            for name, arr in (
                ("attn_norm", layer.input_layernorm.weight), ("wq", a.q_proj.weight), ("wk", a.k_proj.weight),
                ("wv", a.v_proj.weight), ("wo", a.o_proj.weight), ("mlp_norm", layer.post_attention_layernorm.weight),
                ("wgate", mlp.gate_proj.weight), ("wup", mlp.up_proj.weight), ("wdown", mlp.down_proj.weight),
                ("bq", a.q_proj.get("bias")), ("bk", a.k_proj.get("bias")), ("bv", a.v_proj.get("bias")),
            ):
                setattr(spec, name, _ptr(weight(arr)))
        self.layers = layers
        tied = getattr(model, "lm_head", None) is None
        embed = weight(body.embed_tokens.weight)
        head = embed if tied else weight(model.lm_head.weight)
        self.spec = _Model(
            n_layers=len(body.layers), dim=embed.shape[1], n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads,
            head_dim=first.self_attn.q_proj.weight.shape[0] // attn.n_heads, hidden=first.mlp.gate_proj.weight.shape[0],
            vocab=head.shape[0], capacity=0, rope_dims=rope.dims, eps=first.input_layernorm.eps, scale=attn.scale,
            embed=_ptr(embed), final_norm=_ptr(weight(body.norm.weight)), head=_ptr(head), layers=layers,
        )
        self.rope = (float(rope.base), float(rope.scale))

    def layout(self, cache: list) -> tuple[int, int, int] | None:
        """(offset, bits, group) if `cache` is one batch-1 cache per layer at one offset that
        the step can read: plain float32 KVCaches (bits 0), or QuantizedKVCaches of one width
        and group with float32 scales whose rows attention.c takes. Else None."""
        if len(cache) != len(self.layers):
            return None
        kinds = {(type(c), getattr(c, "bits", 0), getattr(c, "group_size", 0)) for c in cache}
        if len(kinds) != 1 or len({c.offset for c in cache}) != 1:
            return None
        kind, bits, group = kinds.pop()
        if kind not in (KVCache, QuantizedKVCache):
            return None
        hd, heads = self.spec.head_dim, (1, self.spec.n_kv_heads)
        if kind is KVCache:
            if any(c.keys is not None and (c.keys.dtype != mx.float32 or c.keys.shape[:2] != heads) for c in cache):
                return None
        elif kind is QuantizedKVCache:
            if kernel_mode() not in ("auto", "kernel"):
                return None  # LMSP_KERNELS=reference|off: MLX runs quantized caches' steps and chunks
            if hd % 32 or group % 32 or hd % group or bits not in (2, 4, 8):
                return None
            widths = (hd * bits // 32, hd // group, hd // group) * 2
            for c in cache:
                parts = () if c.keys is None else (*c.keys, *c.values)
                if any(a.shape[:2] != heads or a.shape[-1] != w for a, w in zip(parts, widths)):
                    return None  # another model's cache, or values narrower than keys
                if any(a.dtype != mx.float32 for a in parts[1:3] + parts[4:]):
                    return None  # a half model's scales
        return cache[0].offset, (bits if kind is QuantizedKVCache else 0), group

    def bind(self, cache: list, positions: int) -> int | None:
        """Point the spec at the caches' buffers if `layout` takes them and they have room
        for `positions` more; returns the offset, or None."""
        found = self.layout(cache)
        if found is None:
            return None
        pos, bits, group = found
        capacity = None
        for c, layer in zip(cache, self.layers):
            if c.keys is None:
                return None
            if bits:
                parts = [_view(a, dtype) for a, dtype in zip((*c.keys, *c.values), (mx.uint32, mx.float32, mx.float32) * 2)]
                shapes = {a.shape[:3] for a in parts if a is not None}
            else:
                parts = [_view(c.keys), _view(c.values)]
                shapes = {a.shape for a in parts if a is not None}
            if any(a is None for a in parts) or len(shapes) != 1:
                return None
            size = shapes.pop()[2]
            if pos + positions > size or capacity not in (None, size):
                return None
            capacity = size
            if bits:
                for name, a in zip(CODES, parts):
                    setattr(layer, name, ctypes.cast(a.ctypes.data, W if name.endswith("codes") else P))
                layer.keys = layer.values = None
            else:
                layer.keys, layer.values = _ptr(parts[0]), _ptr(parts[1])
        self.spec.capacity, self.spec.kv_bits, self.spec.kv_group = capacity, bits, group
        return pos


class DecodeStep:
    """The compiled step bound to one model's weights."""

    def __init__(self, lib, compiled: CompiledModel) -> None:
        self.lib = lib
        self.compiled = compiled
        self.logits = np.empty(compiled.spec.vocab, np.float32)
        self.scratch = np.empty(0, np.float32)

    def __call__(self, token: int, cache: list) -> mx.array | None:
        """Logits (1, 1, vocab) for `token`, its K/V written into `cache`; None where this
        step must go through MLX. A full (or empty) cache is grown first, as MLX grows it: the step
        stays compiled, so a sequence's logits do not depend on where its cache grew (the
        batched step grows it the same way)."""
        if self.compiled.layout(cache) is not None:  # an empty cache gets its first buffer here
            make_room(cache, 1, self.compiled.spec.n_kv_heads, self.compiled.spec.head_dim)
        pos = self.compiled.bind(cache, 1)
        if pos is None:
            return None
        spec = self.compiled.spec
        need = 2 * spec.dim + (2 * spec.n_heads + 2 * spec.n_kv_heads) * spec.head_dim + 2 * spec.hidden \
            + spec.n_heads * (pos + 1)
        if self.scratch.size < need:
            self.scratch = np.empty(max(need, 2 * self.scratch.size), np.float32)
        cos, sin = _rope_tables(pos, 1, spec.rope_dims, *self.compiled.rope)
        cpu_blas.park_blas_threads()
        if self.lib.lmsp_decode_step(ctypes.byref(spec), token, pos, cos.ctypes.data, sin.ctypes.data,
                                     self.logits.ctypes.data, self.scratch.ctypes.data) != 0:
            log.warning("compiled decode step: no memory for its attention state at %d positions; MLX runs it", pos)
            return None  # it failed before writing anything
        for c in cache:
            c.offset += 1
        return mx.array(self.logits)[None, None]


def make_room(cache: list, n: int, kv_heads: int, head_dim: int) -> None:
    """Grow each layer cache that lacks room for `n` more positions, exactly as mlx-lm's
    `update_and_fetch` does (its step size and layout), without advancing it."""
    for c in cache:
        # a QuantizedKVCache's keys are (codes, scales, biases): a tuple, or a list when restored
        rows = None if c.keys is None else (c.keys[0] if isinstance(c, QuantizedKVCache) else c.keys).shape[2]
        if rows is None or c.offset + n > rows:
            zeros = mx.zeros((1, kv_heads, n, head_dim), mx.float32)
            c.update_and_fetch(zeros, zeros)
            c.offset -= n
    mx.eval([(c.keys, c.values) for c in cache])  # the compiled passes write into the evaluated buffers


class BatchStep:
    """The compiled step for several sequences at once (decode.c's `lmsp_decode_batch`):
    each sequence on its own cache, the weights read once for all. The caches are plain
    float32 KVCaches, or QuantizedKVCaches of one width and group (`--kv-bits`), whose
    attention is attention.c's, each sequence split as its step alone splits it."""

    def __init__(self, lib, compiled: CompiledModel) -> None:
        self.lib = lib
        self.compiled = compiled
        self.scratch = np.empty(0, np.float32)

    def kind(self, cache: list) -> tuple[int, int] | None:
        """(bits, group) of a cache a sequence can ride in the batched step with ((0, 0):
        plain float32); sequences of one kind step together. None: not one it reads."""
        found = self.compiled.layout(cache)
        return None if found is None else (found[1], found[2] if found[1] else 0)

    def takes(self, cache: list) -> bool:
        return self.kind(cache) is not None

    def __call__(self, feeds: list[list[int]], caches: list[list], every: list[bool] | None = None) -> mx.array | None:
        """Logits for each sequence after its tokens `feeds[i]` are fed to `caches[i]` (one
        for a decode step, several for a short prompt chunk or a speculative draft, which
        attend causally as a prefill), its K/V written and offsets advanced: the last row's,
        or with `every[i]` one row after each of its tokens (a draft's verification), in
        feed order; None (nothing written) where a cache is not of the one kind `kind` takes."""
        spec = self.compiled.spec
        layers, count = spec.n_layers, sum(len(f) for f in feeds)
        kinds = {self.kind(c) for c in caches}
        if None in kinds or len(kinds) != 1 or any(not 0 <= t < spec.vocab for f in feeds for t in f):
            return None
        bits, group = kinds.pop()
        half = spec.rope_dims // 2
        pos, cap = np.empty(count, np.int32), np.empty(count, np.int32)
        cos, sin = np.empty((count, half), np.float32), np.empty((count, half), np.float32)
        rows = (_Cache * (count * layers))()
        every = every or [False] * len(feeds)
        out_rows = np.empty(sum(len(f) if all_rows else 1 for f, all_rows in zip(feeds, every)), np.int32)
        out = 0
        views = []  # the buffers' numpy views stay alive through the call
        row = 0
        for s, (feed, cache) in enumerate(zip(feeds, caches)):
            make_room(cache, len(feed), spec.n_kv_heads, spec.head_dim)
            buffers = [self._buffers(c, bits, views) for c in cache]
            if any(b is None for b in buffers) or len({b[0] for b in buffers}) != 1:
                return None
            start, size = cache[0].offset, buffers[0][0]
            table = _rope_tables(start, len(feed), spec.rope_dims, *self.compiled.rope)
            for j in range(len(feed)):
                for layer, (_, buffer) in enumerate(buffers):
                    rows[row * layers + layer] = buffer
                pos[row], cap[row] = start + j, size
                cos[row], sin[row] = table[0][j], table[1][j]
                row += 1
            picked = range(row - len(feed), row) if every[s] else (row - 1,)
            out_rows[out : out + len(picked)] = picked
            out += len(picked)
        spec.kv_bits, spec.kv_group = bits, group
        need = self.lib.lmsp_decode_batch_scratch(ctypes.byref(spec), count, pos.ctypes.data)
        if self.scratch.size < need:
            self.scratch = np.empty(max(need, 2 * self.scratch.size), np.float32)
        logits = np.empty((len(out_rows), spec.vocab), np.float32)
        ids = np.asarray([t for f in feeds for t in f], np.int32)
        cpu_blas.park_blas_threads()
        if self.lib.lmsp_decode_batch(ctypes.byref(spec), count, ids.ctypes.data, pos.ctypes.data, cap.ctypes.data,
                                      rows, cos.ctypes.data, sin.ctypes.data, len(out_rows), out_rows.ctypes.data,
                                      logits.ctypes.data, self.scratch.ctypes.data) != 0:
            log.warning("compiled batch step: no memory for %d rows; the sequences step one by one", count)
            return None
        for feed, cache in zip(feeds, caches):
            for c in cache:
                c.offset += len(feed)
        return mx.array(logits)

    @staticmethod
    def _buffers(c, bits: int, views: list) -> tuple[int, _Cache] | None:
        """A layer cache's capacity and its buffers for lmsp_cache (None where a view fails)."""
        if bits:
            parts = [_view(a, dtype) for a, dtype in zip((*c.keys, *c.values), (mx.uint32, mx.float32, mx.float32) * 2)]
            if any(a is None for a in parts) or len({a.shape[:3] for a in parts}) != 1:
                return None
            views += parts
            fields = {name: ctypes.cast(a.ctypes.data, W if name.endswith("codes") else P)
                      for name, a in zip(CODES, parts)}
            return parts[0].shape[2], _Cache(**fields)
        k, v = _view(c.keys), _view(c.values)
        if k is None or v is None or k.shape != v.shape:
            return None
        views += (k, v)
        return k.shape[2], _Cache(keys=_ptr(k), values=_ptr(v))


def _supported(model: nn.Module) -> tuple[nn.Module, nn.RoPE] | None:
    body = getattr(model, "model", None)
    if getattr(model, "model_type", None) not in ("llama", "qwen2") or not isinstance(body, nn.Module):
        return None
    if any(t != "full_attention" for t in getattr(getattr(model, "args", None), "layer_types", None) or ()):
        return None  # sliding-window layers
    layers = getattr(body, "layers", [])
    if not layers:
        return None
    rope = layers[0].self_attn.rope
    rope = rope.rope if isinstance(rope, FusedRoPE) else rope
    if type(rope) is not nn.RoPE or rope.traditional:
        return None
    for layer in layers:
        a, mlp = layer.self_attn, layer.mlp
        linears = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(type(m) is not nn.Linear for m in linears) or any("bias" in m for m in linears[3:]):
            return None
        if type(layer.input_layernorm) is not nn.RMSNorm or type(layer.post_attention_layernorm) is not nn.RMSNorm:
            return None
    return body, rope


def compile_model(model: nn.Module, lib, switch: str, what: str) -> CompiledModel | None:
    """The model's weights bound for a compiled pass, or None where the pass cannot take
    it: no compiled library, `switch`=0 in the environment, or a layout it does not know."""
    if lib is None or os.environ.get(switch, "1") == "0":
        return None
    found = _supported(model)
    if found is None:
        return None
    try:
        return CompiledModel(model, *found)
    except (ValueError, AttributeError) as exc:
        log.info("%s not used: %s", what, exc)
        return None


def decode_steps(model: nn.Module) -> tuple[DecodeStep, BatchStep] | None:
    """The compiled one-sequence and batched steps bound to `model`'s weights, where they
    apply (not under LMSP_CPU_DECODE=0)."""
    lib = cpu_blas.decode_kernel()
    compiled = compile_model(model, lib, "LMSP_CPU_DECODE", "compiled decode step")
    return None if compiled is None else (DecodeStep(lib, compiled), BatchStep(lib, compiled))
