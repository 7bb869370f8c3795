"""Building a model with our ops in it, without changing mlx-lm.

mlx-lm's model code calls a few functions by their module-level name: attention through
`scaled_dot_product_attention`, the MLP through `swiglu`. Ours replace them for two
reasons: the CPU backend's fast math (cpu_math.OPS) and the quantized-KV decode kernel on
every backend (kernels.attention_op). Setting them in mlx-lm's module would change every
model of that family in the process, for as long as the process lives. Instead, the
loader hands mlx-lm's `load_model` its own `get_model_classes` (mlx-lm's seam for this),
which runs the model's module afresh as a private copy, binds our functions in that copy
and returns its classes:
- mlx-lm's modules are never touched: unloading a model leaves mlx-lm as it was, and two
  models of one family may carry different ops;
- only names the module holds from mlx-lm itself are bound (its `swiglu` is
  `activations.swiglu`, its attention `base.scaled_dot_product_attention`); a module with
  its own attention keeps it;
- only the module that defines `Model` is copied: classes it takes from another model
  module keep that module's ops. The load log names what was bound.

The MoE expert kernel enters as a module in the tree (kernels.expert_layers), and the CPU's
fused RoPE as a wrapper of each RoPE layer (cpu_math.wrap_ropes): both in the loaded
model's own tree, not by name.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base
from mlx_lm.models.cache import QuantizedKVCache
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import _get_classes, load_adapters, load_model

from .. import kernels
from ..cache.batch import BatchQuantizedKVCache
from . import cpu_math
from .distributed import Ranks, split

log = logging.getLogger("lmsp_mlx.engine")


@dataclass
class Built:
    """A loaded model and what went into it besides mlx-lm's own code (for the load log)."""

    model: nn.Module
    tokenizer: Any  # mlx-lm's TokenizerWrapper
    config: dict
    ops: list[str] = field(default_factory=list)  # names bound in the module copy


def module_ops(backend: str) -> dict[str, tuple[Callable, Callable]]:
    """What a copy of a model's module binds on `backend`: name -> (mlx-lm's, ours)."""
    ops = dict(cpu_math.OPS) if backend == "cpu" else {}
    attention, inner = ops.get("scaled_dot_product_attention", (base.scaled_dot_product_attention,) * 2)
    kernel = kernels.attention_op(inner, (QuantizedKVCache, BatchQuantizedKVCache))
    if kernel is not None:
        ops["scaled_dot_product_attention"] = (attention, kernel)
    return ops


def private_copy(module: ModuleType) -> ModuleType:
    """`module` executed afresh under its own name, not registered in sys.modules: its
    relative imports resolve as the original's, and its globals are its own."""
    spec = importlib.util.spec_from_file_location(module.__name__, module.__file__)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    return copy


def build(path: Path, backend: str, adapter: Path | None, ranks: Ranks | None = None) -> Built:
    """Load the model directory at `path` as mlx-lm's `load` does, with `module_ops`
    bound in a copy of its module (the loader then adds the modules of its own: the expert
    kernel's layers, the CPU's fused RoPE). With `ranks`, the model is cut to this rank's
    part (engine/distributed.py) before its weights are read: a rank reads only its own."""
    bound: list[str] = []

    def classes(config: dict) -> tuple[type, type]:
        model_class, args_class = _get_classes(config)
        module = sys.modules[model_class.__module__]
        ops = {name: ours for name, (theirs, ours) in module_ops(backend).items() if vars(module).get(name) is theirs}
        if not ops:
            return model_class, args_class
        copy = private_copy(module)
        for name, ours in ops.items():
            setattr(copy, name, ours)
        bound.extend(ops)
        return copy.Model, copy.ModelArgs

    model, config = load_model(path, lazy=ranks is not None, get_model_classes=classes)
    if ranks is not None:
        held = split(model, ranks)
        mx.eval(model.parameters())
        log.info("rank %d of %d holds %s", ranks.rank, ranks.size, held)
    if adapter is not None:
        model = load_adapters(model, str(adapter))
        model.eval()
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return Built(model, tokenizer, config, bound)
