"""The runner seam: one runner per model, chosen at load and logged in one line, and a
loaded model that leaves mlx-lm as it was (no class swapped, no module function replaced)."""

from __future__ import annotations

import gc

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import activations, base, gpt_oss, llama, qwen3_moe, switch_layers
from mlx_lm.models.cache import make_prompt_cache

from lmsp_mlx import cpu_blas, kernels
from lmsp_mlx.engine.loader import load_model
from lmsp_mlx.engine.runners import CompiledCPURunner, MLXRunner

from tests.tiny_model import build_tiny_family_model

STOCK = {
    "llama": (llama, {"swiglu": activations.swiglu, "scaled_dot_product_attention": base.scaled_dot_product_attention}),
    "gpt_oss": (gpt_oss, {"scaled_dot_product_attention": base.scaled_dot_product_attention}),
}


def runner_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("runner for ")]


@pytest.mark.skipif(cpu_blas.decode_kernel() is None, reason="the compiled decode step is not built")
def test_a_llama_float32_model_on_the_cpu_gets_the_compiled_runner_and_without_it_mlx(tmp_path, monkeypatch, caplog):
    build_tiny_family_model(tmp_path / "llama", "llama")
    with caplog.at_level("INFO", logger="lmsp_mlx.engine"):
        lm = load_model(tmp_path / "llama")
    assert isinstance(lm.runner, CompiledCPURunner) and lm.runner.batch is not None
    assert runner_lines(caplog) == ["runner for llama: compiled CPU (decode step, batched step, prefill: cpu_blas), "
                                    "MLX for the rest"]
    caplog.clear()
    monkeypatch.setenv("LMSP_CPU_DECODE", "0")
    monkeypatch.setenv("LMSP_CPU_PREFILL", "0")
    with caplog.at_level("INFO", logger="lmsp_mlx.engine"):
        lm = load_model(tmp_path / "llama")
    assert type(lm.runner) is MLXRunner and lm.runner.kind == "mlx"
    assert runner_lines(caplog) == ["runner for llama: MLX (the model's own forward; batched decode on merged caches)"]


@pytest.mark.parametrize("family", sorted(STOCK))
def test_loading_and_unloading_a_model_leaves_mlx_lm_as_it_was(tmp_path, family):
    module, functions = STOCK[family]
    call = module.Model.__call__
    build_tiny_family_model(tmp_path / family, family)
    lm = load_model(tmp_path / family)
    assert type(lm.model).__name__ == "Model" and type(lm.model).__call__ is not call  # the loader's own copy
    assert lm.model.__class__.__call__.__globals__ is not vars(module)
    cache = make_prompt_cache(lm.model)
    mx.eval(lm.runner.last_logits([1, 2, 3], cache))
    assert {name: vars(module)[name] for name in functions} == functions
    assert module.Model.__call__ is call
    del lm, cache
    gc.collect()
    assert {name: vars(module)[name] for name in functions} == functions


def test_the_expert_kernel_replaces_moe_layers_in_the_tree_not_their_class(monkeypatch):
    """A quantized MoE model's SwitchGLUs become KernelSwitchGLUs holding the same
    projections; mlx-lm's SwitchGLU class is untouched and the greedy logits agree."""
    monkeypatch.setenv("LMSP_KERNELS", "auto")
    config = {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "max_position_embeddings": 512, "tie_word_embeddings": False, "norm_topk_prob": True}
    mx.random.seed(0)
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda _, m: hasattr(m, "num_experts"))
    mx.eval(model.parameters())
    tokens = mx.array([[5, 6, 7, 8]])
    want = model(tokens)
    experts = [m.mlp.switch_mlp for m in model.layers]
    assert kernels.expert_layers(model) == 2
    assert all(type(m.mlp.switch_mlp) is kernels.KernelSwitchGLU for m in model.layers)
    assert all(m.mlp.switch_mlp.gate_proj is e.gate_proj for m, e in zip(model.layers, experts))
    assert all(type(e) is switch_layers.SwitchGLU for e in experts)
    assert switch_layers.SwitchGLU.__call__ is not kernels.KernelSwitchGLU.__call__
    got = model(tokens)
    assert mx.abs(got - want).max().item() < 1e-3


@pytest.mark.skipif(cpu_blas.decode_kernel() is None, reason="the compiled CPU kernels are not built")
def test_float_moe_layers_are_grouped_by_expert_on_the_cpu_build_and_say_so(tmp_path, monkeypatch, caplog):
    """A float32 MoE model (gpt-oss) on the CPU build: each SwitchGLU becomes a
    GroupedSwitchGLU over the same projections, in the tree (mlx-lm's class untouched), and
    the load log names it; under LMSP_KERNELS=off the model keeps mlx-lm's layers."""
    monkeypatch.setenv("LMSP_KERNELS", "auto")
    build_tiny_family_model(tmp_path / "gpt_oss", "gpt_oss")
    with caplog.at_level("INFO", logger="lmsp_mlx"):
        lm = load_model(tmp_path / "gpt_oss")
    layers = lm.model.model.layers
    assert all(type(layer.mlp.experts) is kernels.GroupedSwitchGLU for layer in layers)
    assert switch_layers.SwitchGLU.__call__ is not kernels.GroupedSwitchGLU.__call__
    assert any("expert_product (float experts grouped by expert, 4 MoE layers)" in r.getMessage()
               for r in caplog.records)
    monkeypatch.setenv("LMSP_KERNELS", "off")
    plain = load_model(tmp_path / "gpt_oss")
    assert all(type(layer.mlp.experts) is switch_layers.SwitchGLU for layer in plain.model.model.layers)
    cache, plain_cache = make_prompt_cache(lm.model), make_prompt_cache(plain.model)
    tokens = [3, 9, 4, 12, 7, 5, 8]  # 7 tokens: the grouped product, not mlx-lm's one-token path
    got, want = lm.runner.last_logits(tokens, cache), plain.runner.last_logits(tokens, plain_cache)
    assert mx.abs(got - want).max().item() < 1e-4 * max(mx.abs(want).max().item(), 1.0)
