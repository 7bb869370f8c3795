"""Load an mlx-lm model directory for serving.

On Metal a quantized model stays quantized. MLX's CPU backend has no fast quantized or
half-precision matmul (see docs/cpu-backend.md), so there every weight is made float32 at
load time; the model listing reports which.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn

from .distributed import DistributedError, Ranks
from .embed import LM_POOLING, EmbeddingSpec, embedding_spec
from .encoder import ENCODER_TYPES, encoder_context, load_encoder_weights
from .render import apply_template, with_template_args

if TYPE_CHECKING:
    from .runners import Runner

log = logging.getLogger("lmsp_mlx.engine")

# "conversations": previous_response_id, which the store every server has serves for every model
CAPABILITIES = ("text", "tools", "structured_output", "conversations")


class ModelLoadError(RuntimeError):
    """The model path cannot be served; the message is one line for the user."""


@dataclass
class LoadedModel:
    id: str
    path: Path
    model: nn.Module
    runner: Runner  # what every step runs through (engine/runners.py), chosen at load
    tokenizer: Any  # mlx_lm TokenizerWrapper
    context_length: int
    quantization: str
    backend: str
    capabilities: tuple[str, ...] = CAPABILITIES
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    # The tokenizer's special tokens (<|im_start|>, <|endoftext|>, ...): no text in a text completion
    special_token_ids: frozenset[int] = field(default_factory=frozenset)
    fingerprint: str = ""  # what KV checkpoints are tied to: weights, config, runtime dtype
    kv_cache: str = "float"  # or "<bits>-bit, group <n>" under --kv-bits
    default_max_output_tokens: int | None = None  # --max-output-tokens: a request's limit when it sets none
    adapter: Path | None = None  # the LoRA adapter fused into its weights (--adapter-path)
    vocab_size: int | None = None  # its embedding rows (its logits' width): every token id is below it
    embedding: EmbeddingSpec | None = None  # a dedicated embedding model's pooling (engine/embed.py); it then only embeds
    model_type: str = ""  # its config's, which names the mlx-lm family


    def describe(self) -> dict[str, Any]:
        doc = {
            "id": self.id,
            "object": "model",
            "context_length": self.context_length,
            "capabilities": list(self.capabilities),
            "quantization": self.quantization,
            "backend": self.backend,
            "kv_cache": self.kv_cache,
            # what a request that sets no output limit gets (null: the rest of the context)
            "default_max_output_tokens": self.default_max_output_tokens,
            "reasoning": "reasoning" in self.capabilities,  # reasoning.effort "none" turns it off (enable_thinking)
        }
        if self.adapter is not None:
            doc["adapter"] = self.adapter.name
        if self.backend == "cpu":
            from ..cpu_blas import status

            doc["cpu_matmul"] = status()  # "stock" or the BLAS the float32 matmuls run on
        return doc


@dataclass(frozen=True)
class LoadOptions:
    """How a model directory is served besides its own files (serve.py's flags)."""

    chat_template: str | None = None  # --chat-template: replaces the tokenizer's own
    template_args: dict = field(default_factory=dict)  # --chat-template-args: passed to every rendering
    adapter_path: Path | None = None  # --adapter-path: mlx-lm LoRA adapters, fused into the weights at load
    memory_budget: int | None = None  # --memory-budget-mb, in bytes (default: engine/footprint.py's)
    ranks: Ranks | None = None  # the mlx.launch ranks the model is split over (engine/distributed.py)


def backend_name() -> str:
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "cpu"


def check_model_dir(path: Path) -> dict:
    """Validate a directory before the (slow) load; returns its config."""
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} is not a directory")
    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelLoadError(f"{path} has no config.json: not an mlx-lm model directory")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{config_file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelLoadError(f"{config_file} has no model_type")
    if not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path} has no .safetensors weights")
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise ModelLoadError(f"{path} has no tokenizer files")
    return config


def _to_float32(model: nn.Module) -> bool:
    """Dequantize the quantized layers to float32 and cast the rest to float32, except
    MoE experts (QuantizedSwitchLinear), which stay quantized: they are most of an MoE
    model's weights (a 30B-A3B model would take 120 GB in float32), a decode step reads
    only the chosen few, and the expert kernel's dispatch runs them. True if any stayed."""
    from mlx.utils import tree_unflatten
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    swaps, experts = [], False
    for name, module in model.named_modules():
        if isinstance(module, QuantizedSwitchLinear):
            experts = True
            continue
        if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        # float32 scales and biases make mx.dequantize produce exact float32 weights.
        weight = mx.dequantize(module.weight, module.scales.astype(mx.float32),
                               None if module.get("biases") is None else module.biases.astype(mx.float32),
                               module.group_size, module.bits, module.mode)
        if isinstance(module, nn.QuantizedEmbedding):
            plain = nn.Embedding(*weight.shape)
        else:
            plain = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            if "bias" in module:
                plain.bias = module.bias
        plain.weight = weight
        swaps.append((name, plain))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    model.set_dtype(mx.float32)  # floating parameters only: packed expert codes stay uint32
    mx.eval(model.parameters())
    return experts


def fingerprint(path: Path, runtime: str, adapter: Path | None = None) -> str:
    """A hash that changes when the weights, the config, the adapter or the runtime dtype
    change: KV checkpoints and sealed state of one never meet another.

    Hashing every byte of a 20 GB model would add minutes to each start, so each weights
    file contributes its name, size, safetensors header (names, shapes, dtypes, offsets)
    and its first and last MiB."""
    h = hashlib.sha256()
    h.update((path / "config.json").read_bytes())
    h.update(runtime.encode())
    files = sorted(path.glob("*.safetensors"))
    if adapter is not None:
        h.update(b"adapter:" + (adapter / "adapter_config.json").read_bytes())
        files += sorted(adapter.glob("*.safetensors"))
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()


def _check_template(tokenizer, name: str) -> None:
    """A --chat-template that does not compile, or settings it rejects, fail the load (a start
    error) rather than every request after it: one user message must render."""
    try:
        apply_template(tokenizer, [{"role": "user", "content": "Hi"}])
    except Exception as exc:  # jinja's syntax and undefined errors, the template's own raise_exception
        raise ModelLoadError(f"the chat template of {name} (--chat-template, --chat-template-args) cannot "
                             f"render a conversation: {type(exc).__name__}: {' '.join(str(exc).split())}") from None


def _describe_quantization(config: dict) -> str:
    q = config.get("quantization")
    if not q:
        return config.get("torch_dtype") or "float"
    return f"{q.get('mode', 'affine')}-{q['bits']}bit-g{q['group_size']}"


def check_fits(path: Path, config: dict, backend: str, override: int | None, name: str | None = None,
               ranks: int = 1) -> int:
    """The model's estimated size after loading (with `ranks`, one rank's part of it);
    ModelLoadError where it exceeds the budget (per rank). `name`: what the messages call
    it (its id; a hub snapshot's directory is a commit hash)."""
    name = name or path.name
    from .footprint import budget_bytes, estimate_bytes, gb

    need = estimate_bytes(path, config, backend, ranks)
    budget, why = budget_bytes(override)
    if budget is not None and need > budget:
        form = "float32 on the CPU build" if backend == "cpu" else "as stored"
        if ranks > 1:
            form += ", this rank's part"
        raise ModelLoadError(f"{name} needs about {gb(need)} once loaded ({form}) but {gb(budget)} may be used "
                             f"({why}); serve a smaller model or free memory")
    part = f" (this rank's part of {ranks})" if ranks > 1 else ""
    log.info("%s: about %s once loaded%s%s", name, gb(need), part, f", of {gb(budget)} ({why})" if budget else "")
    return need


def check_adapter_dir(path: Path) -> None:
    if not (path / "adapter_config.json").is_file() or not (path / "adapters.safetensors").is_file():
        raise ModelLoadError(f"adapter path {path} has no adapter_config.json and adapters.safetensors "
                             "(mlx-lm's adapter layout, as mlx_lm.lora writes it)")


def _fuse_adapters(model: nn.Module, dequantize: bool) -> int:
    """Fold each LoRA (or DoRA) layer into the weight it adapts, as `mlx_lm.fuse` does: the
    model is then plain layers, which every fast path here (compiled CPU calls, kernels) takes."""
    from mlx.utils import tree_unflatten

    fused = [(name, module.fuse(dequantize=dequantize)) for name, module in model.named_modules()
             if hasattr(module, "fuse") and hasattr(module, "lora_a")]
    if fused:
        model.update_modules(tree_unflatten(fused))
    return len(fused)


def load_model(path: Path, *, model_id: str | None = None, ctx: int | None = None,
               options: LoadOptions = LoadOptions()) -> LoadedModel:
    from .model_ops import build
    from .runners import choose

    config = check_model_dir(path)
    name = model_id or path.name  # a hub snapshot's directory is a commit hash
    backend = backend_name()
    adapter = options.adapter_path
    if adapter is not None:
        check_adapter_dir(adapter)
    check_fits(path, config, backend, options.memory_budget, name, options.ranks.size if options.ranks else 1)
    if config["model_type"] in ENCODER_TYPES:
        return _load_encoder(path, config, name, backend, options)
    from .. import kernels

    try:
        kernels.mode()
    except ValueError as exc:  # a bad LMSP_KERNELS value
        raise ModelLoadError(str(exc)) from None
    log.info("loading %s on %s%s", path, backend, f" with the adapter {adapter}" if adapter else "")
    try:
        built = build(path, backend, adapter, options.ranks)
    except DistributedError as exc:
        raise ModelLoadError(f"cannot split {name} over {options.ranks.size} ranks: {exc}") from None
    except Exception as exc:  # mlx-lm raises many kinds for a broken directory (or an adapter of another base)
        what = f"the adapter {adapter} on {path}" if adapter else path
        raise ModelLoadError(f"cannot load {what}: {type(exc).__name__}: {' '.join(str(exc).split())}") from None
    model, tokenizer = built.model, built.tokenizer
    if adapter is not None:
        log.info("adapter %s: %d LoRA layers fused into the weights", adapter.name,
                 _fuse_adapters(model, dequantize=backend == "cpu"))
    if options.chat_template is not None:
        tokenizer.chat_template = options.chat_template  # the Hugging Face tokenizer's, which renders it
        tokenizer.has_chat_template = True
    tokenizer = with_template_args(tokenizer, options.template_args)
    if options.chat_template is not None or options.template_args:
        _check_template(tokenizer, name)
    stored = _describe_quantization(config)
    if backend == "cpu":
        from ..cpu_blas import status
        from . import cpu_math

        if status() == "stock" and sys.platform.startswith("linux") and not os.environ.get("LMSP_STOCK_BLAS"):
            log.warning("MLX's float32 matmuls run on its stock reference BLAS (slow): call "
                        "lmsp_mlx.cpu_blas.accelerate() before anything imports mlx.core")

        experts = _to_float32(model)
        quantization = "float32" if stored.startswith("float") else f"float32 (dequantized from {stored})"
        if experts:
            quantization = f"float32, MoE experts {stored}"
        ropes = cpu_math.wrap_ropes(model)
        if built.ops or ropes:
            log.info("CPU fast math for %s: %s", name, ", ".join(built.ops + (["rope"] if ropes else [])))
    else:
        quantization = stored
    experts_on_kernel, grouped = kernels.expert_layers(model), kernels.float_expert_layers(model)
    swapped = ([f"expert_swiglu ({experts_on_kernel} MoE layers)"] if experts_on_kernel else []) \
        + ([f"expert_product (float experts grouped by expert, {grouped} MoE layers)"] if grouped else []) \
        + (["decode_attention (--kv-bits caches)"]
           if kernels.mode() != "off" and "scaled_dot_product_attention" in built.ops else [])
    if swapped:
        log.info("kernels for %s (LMSP_KERNELS=%s, backend %s): %s", name, kernels.mode(),
                 kernels.backend() or "cpu: compiled CPU kernels where they take the call, else references",
                 ", ".join(swapped))
    runner = choose(model, backend, name, distributed=options.ranks is not None)
    text = text_config(config)
    trained = int(text.get("max_position_embeddings") or text.get("max_seq_len") or 4096)
    context_length = ctx or trained
    if context_length > trained:
        log.warning("--ctx %d exceeds the %d positions %s was trained on", ctx, trained, name)
    eos = set(tokenizer.eos_token_ids or ())
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special = set(getattr(tokenizer, "all_special_ids", None) or ()) | {i for i, t in added.items()
                                                                         if getattr(t, "special", False)}
    capabilities = CAPABILITIES + (("reasoning",) if getattr(tokenizer, "has_thinking", False) else ()) + ("embeddings",)
    if (embedding := embedding_spec(path)) is not None:
        log.info("%s is an embedding model (sentence-transformers layout: %s pooling%s): it serves embeddings only",
                 name, embedding.pooling, ", normalised" if embedding.normalize else "")
        capabilities = ("embeddings",)
    return LoadedModel(
        id=name,
        path=path,
        model=model,
        runner=runner,
        tokenizer=tokenizer,
        context_length=context_length,
        quantization=quantization,
        backend=backend,
        eos_token_ids=frozenset(eos),
        special_token_ids=frozenset(special),
        capabilities=capabilities,
        embedding=embedding,
        model_type=str(config["model_type"]),
        fingerprint=fingerprint(path, f"{backend}:{quantization}", adapter),
        adapter=adapter,
        vocab_size=int(text["vocab_size"]) if text.get("vocab_size") else None,
    )


def _load_encoder(path: Path, config: dict, name: str, backend: str, options: LoadOptions) -> LoadedModel:
    """An encoder embedding model (engine/encoder.py): float32, its tokenizer as Hugging Face
    reads it, embeddings only."""
    from transformers import AutoTokenizer

    from .runners import MLXRunner

    if options.ranks is not None or options.adapter_path is not None:
        raise ModelLoadError(f"{name} is an encoder embedding model: it is served whole, without adapters")
    log.info("loading %s on %s: an encoder embedding model (%s)", path, backend, config["model_type"])
    try:
        model = load_encoder_weights(path, config)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ModelLoadError(f"cannot load {path}: {type(exc).__name__}: {' '.join(str(exc).split())}") from None
    spec = embedding_spec(path) or LM_POOLING
    log.info("%s serves embeddings only: %s pooling%s, up to %d tokens an input", name, spec.pooling,
             ", normalised" if spec.normalize else "", encoder_context(path, config))
    return LoadedModel(
        id=name, path=path, model=model, runner=MLXRunner(model), tokenizer=tokenizer,
        context_length=encoder_context(path, config), quantization="float32", backend=backend,
        capabilities=("embeddings",), embedding=spec, fingerprint=fingerprint(path, f"{backend}:float32", None),
        vocab_size=int(config["vocab_size"]),
    )


def text_config(config: dict) -> dict:
    """The language model's settings: a multimodal checkpoint (Qwen3.5, Gemma 3, ...) keeps
    them under `text_config`, which wins over the top level; a text-only one at the top."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config
