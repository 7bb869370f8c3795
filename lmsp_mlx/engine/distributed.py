"""One model across several processes (ranks) that `mlx.launch` starts, over MLX's own
distributed engine (`mlx.core.distributed`: `ring` over TCP, `jaccl` over Thunderbolt RDMA).
Nothing here moves bytes itself: the collectives are MLX's.

- `join`: the ranks this process is one of, when `mlx.launch` started it (it sets
  MLX_RANK); None for a process on its own.
- `split`: the loaded (still lazy) model cut to this rank's part, before its weights are
  read, so that a rank reads only its own:
  - tensor parallel (the default): mlx-lm's `Model.shard(group)`, which splits every
    layer's heads and MLP columns over the ranks and sums their outputs (all_sum);
  - pipeline parallel: mlx-lm's `pipeline(group)` where the model's body has it
    (`PipelineMixin`), else `LayerPipeline` (llama, and the other bodies whose layers are
    called as `layer(h, mask, cache)`). Rank 0 holds the last layers, the highest rank the
    first; each hands its hidden state to the next with send/recv, and the output is
    gathered so that every rank samples from the same logits.

Invariant: every rank calls the model with the same shapes in the same order; the
collectives inside a forward pass wait for all ranks.
"""

from __future__ import annotations

import logging
import os
import pickle
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.pipeline import PipelineMixin

log = logging.getLogger("lmsp_mlx.engine")

Parallelism = Literal["tensor", "pipeline"]
Backend = Literal["any", "ring", "jaccl", "mpi"]


class DistributedError(Exception):
    """A start error of a distributed server, in one line."""


@dataclass(frozen=True)
class Ranks:
    group: Any  # mx.distributed.Group
    parallel: Parallelism

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()


def launched() -> bool:
    """Whether `mlx.launch` started this process (it sets MLX_RANK for every rank)."""
    return "MLX_RANK" in os.environ


def join(parallel: Parallelism, backend: Backend = "any") -> Ranks | None:
    """The ranks of this `mlx.launch` run; None where this process runs alone."""
    if not launched():
        return None
    if not mx.distributed.is_available(backend):
        raise DistributedError(f"this MLX build has no {backend!r} distributed backend")
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as exc:
        raise DistributedError(f"cannot join the other ranks ({backend}): {' '.join(str(exc).split())}") from None
    return Ranks(group, parallel) if group.size() > 1 else None


def share(obj: Any, ranks: Ranks) -> Any:
    """Rank 0's `obj` on every rank: its pickle, summed over the ranks (the others add
    zeros). Every rank must call it at the same point; the others' `obj` is ignored. None
    costs one collective (its size, 0), anything else two. The ranks are one program
    launched together, so their pickles are trusted."""
    if ranks.rank == 0:
        if obj is None:
            mx.eval(mx.distributed.all_sum(mx.array([0]), group=ranks.group, stream=mx.cpu))
            return None
        data = mx.array(memoryview(pickle.dumps(obj)), dtype=mx.uint8)
        mx.eval(mx.distributed.all_sum(mx.array([data.size]), group=ranks.group, stream=mx.cpu))
        mx.eval(mx.distributed.all_sum(data, group=ranks.group, stream=mx.cpu))
        return obj
    size = mx.distributed.all_sum(mx.array([0]), group=ranks.group, stream=mx.cpu).item()
    if size == 0:
        return None
    data = mx.distributed.all_sum(mx.zeros(size, dtype=mx.uint8), group=ranks.group, stream=mx.cpu)
    return pickle.loads(bytes(memoryview(data)))


def same_everywhere(value: int, ranks: Ranks) -> bool:
    """Whether every rank passed this same `value`, and it is not negative (every rank must call it)."""
    values = mx.distributed.all_gather(mx.array([value], dtype=mx.int64), group=ranks.group, stream=mx.cpu).tolist()
    return value >= 0 and all(v == value for v in values)


def gather_memory(ranks: Ranks) -> list[int]:
    """Each rank's MLX active memory in bytes, by rank (every rank must call it)."""
    mine = mx.array([mx.get_active_memory()], dtype=mx.int64)
    return [int(v) for v in mx.distributed.all_gather(mine, group=ranks.group, stream=mx.cpu).tolist()]


def same_random_state(ranks: Ranks) -> None:
    """Seed every rank's MLX random state alike, so that unseeded sampling draws the same
    tokens on every rank (each samples from the same logits)."""
    seed = mx.distributed.all_sum(mx.random.state[0], group=ranks.group, stream=mx.cpu).view(mx.uint64)
    mx.random.seed(int(seed[0].item()))


def split(model: nn.Module, ranks: Ranks) -> str:
    """Cut `model` to this rank's part, in place, before its weights are evaluated; what
    this rank holds, in words (the load log's line)."""
    return _tensor(model, ranks) if ranks.parallel == "tensor" else _pipeline(model, ranks)


def _tensor(model: nn.Module, ranks: Ranks) -> str:
    if "shard" not in type(model).__dict__:  # mlx-lm's tensor-parallel sharding, where the family has it
        raise DistributedError(f"{type(model).__module__} has no tensor-parallel sharding in mlx-lm: "
                               "use --pipeline")
    args = model.args
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(args, field, None)
        if isinstance(value, int) and value % ranks.size:
            raise DistributedError(f"{field} = {value} cannot be split over {ranks.size} ranks")
    model.shard(ranks.group)
    return f"1/{ranks.size} of every layer's heads and MLP (tensor parallel)"


def _pipeline(model: nn.Module, ranks: Ranks) -> str:
    body = model.model
    layers = len(body.layers)
    if layers < ranks.size:
        raise DistributedError(f"{layers} layers cannot be split over {ranks.size} ranks")
    if isinstance(body, PipelineMixin):
        body.pipeline(ranks.group)
        start, end = body.start_idx, body.end_idx
    elif type(model).__module__ in LAYER_PIPELINE_FAMILIES:
        model.model = LayerPipeline(body, ranks)
        start, end = model.model.start, model.model.end
    else:
        raise DistributedError(f"{type(model).__module__} has no pipeline split (neither mlx-lm's nor ours): "
                               "leave --pipeline out for tensor parallelism")
    return f"layers {start}-{end - 1} of {layers} (pipeline parallel)"


# The bodies LayerPipeline runs as their own forward does: embeddings, then
# `layer(h, mask, cache)` with a full or sliding-window mask, then the norm. Another body
# (gemma's scaled embeddings, a hybrid's per-kind masks) would be run wrongly, so it is
# named here only once its forward is checked against this one.
LAYER_PIPELINE_FAMILIES = ("mlx_lm.models.llama",)


class LayerPipeline(nn.Module):
    """A body that runs only this rank's layers (the split of mlx-lm's `PipelineMixin`:
    rank 0 the last ones), for models whose body lacks `pipeline` and calls its layers as
    `layer(h, mask, cache)` with `embed_tokens`, `layers` and `norm` (llama's). The other
    ranks' layers are dropped before their weights are read. `layers` is this rank's alone,
    so the model's cache has an entry for each layer it runs, as mlx-lm's pipelined models'
    caches do (their `layers` is `pipeline_layers`): every cache of the batch holds rows."""

    def __init__(self, body: nn.Module, ranks: Ranks) -> None:
        super().__init__()
        n, size, rank = len(body.layers), ranks.size, ranks.rank
        base, extra = divmod(n, size)
        split = [base + (1 if r < extra else 0) for r in range(size)]
        self.start = sum(split[rank + 1 :])
        self.end = self.start + split[rank]
        self.rank, self.size, self.group = rank, size, ranks.group
        self.embed_tokens, self.norm = body.embed_tokens, body.norm
        self.sliding_window = body.get("sliding_window")  # read by llama's make_cache
        self.layers = body.layers[self.start : self.end]

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None) -> mx.array:
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        cache = cache if cache is not None else [None] * len(self.layers)  # this rank's layers' caches
        masks: dict[bool, Any] = {}  # one for full layers, one for sliding ones (llama's layer_types)
        if self.rank < self.size - 1:  # the layers before ours ran on the next rank up
            h = mx.distributed.recv_like(h, self.rank + 1, group=self.group)
        for layer, c in zip(self.layers, cache):
            sliding = bool(layer.get("use_sliding", False))
            if sliding not in masks:
                masks[sliding] = create_attention_mask(h, c, window_size=self.sliding_window if sliding else None)
            h = layer(h, masks[sliding], cache=c)
        if self.rank != 0:
            h = mx.distributed.send(h, self.rank - 1, group=self.group)
            if cache[-1] is not None:  # the send runs when the cache is evaluated
                cache[-1].keys = mx.depends(cache[-1].keys, h)
        h = mx.distributed.all_gather(h, group=self.group)[: h.shape[0]]  # rank 0's: the last layer's
        return self.norm(h)

