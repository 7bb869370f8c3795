"""`--adapter-path DIR`: mlx-lm LoRA adapters on the served model.

The adapter is made here with mlx-lm's own LoRA utilities (the layers `mlx_lm.lora`
trains, saved in its layout) and given weights that change the model's greedy choices.
The server must then answer exactly as `mlx_lm.generate` does with the same adapter."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from lmsp_mlx import flags, serve
from lmsp_mlx.engine.loader import LoadOptions, load_model
from tests.helpers import HTTP

PROMPT = [5, 40, 41, 42, 43, 44]
TOKENS = 12


def make_adapter(model_dir: Path, out: Path, seed: int = 3) -> Path:
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    model, _ = load(str(model_dir))
    config = {"fine_tune_type": "lora", "num_layers": 2,
              "lora_parameters": {"rank": 4, "scale": 20.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "mlp.up_proj"]}}
    model.freeze()  # as mlx_lm.lora: only the LoRA layers train, and only they are saved
    linear_to_lora_layers(model, config["num_layers"], config["lora_parameters"])
    mx.random.seed(seed)
    adapters = {}
    for name, value in tree_flatten(model.trainable_parameters()):
        adapters[name] = mx.random.normal(value.shape) * 0.5 if name.endswith("lora_b") else value
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), adapters)
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapter") / "lora")


def reference(model_dir: Path, adapter: Path | None) -> str:
    from mlx_lm import generate, load

    model, tokenizer = load(str(model_dir), adapter_path=str(adapter) if adapter else None)
    return generate(model, tokenizer, PROMPT, max_tokens=TOKENS, verbose=False)


def completion(server, model: str) -> str:
    r = HTTP.post(server.url + "/v1/completions", timeout=120,
                   json={"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_the_adapter_changes_the_greedy_tokens_as_mlx_lm_generate_does(start_server, tiny_model_dir, adapter_dir):
    expected = reference(tiny_model_dir, adapter_dir)
    assert expected != reference(tiny_model_dir, None)  # the adapter does change them
    server = start_server("--model", str(tiny_model_dir), "--adapter-path", str(adapter_dir), "--no-kv-disk")
    assert completion(server, tiny_model_dir.name) == expected
    model = HTTP.get(f"{server.url}/lmsp/v1/models/{tiny_model_dir.name}").json()
    assert model["adapter"] == adapter_dir.name


def test_the_fingerprint_keeps_the_adapters_checkpoints_apart(tiny_model_dir, adapter_dir):
    base = load_model(tiny_model_dir).fingerprint
    adapted = load_model(tiny_model_dir, options=LoadOptions(adapter_path=adapter_dir)).fingerprint
    assert base != adapted


def test_an_adapter_of_another_base_is_a_start_error(tiny_model_dir, tmp_path):
    from tests.tiny_model import build_tiny_model

    other = build_tiny_model(tmp_path / "wide", head_dim=32)  # other shapes of q_proj
    wrong = make_adapter(other, tmp_path / "wrong")
    args = flags.parse(["--model", str(tiny_model_dir), "--adapter-path", str(wrong), "--no-kv-disk",
                             "--store", str(tmp_path / "s.sqlite3"), "--state-key-file", str(tmp_path / "k"),
                             "--port", "1"])
    with pytest.raises(serve.StartError, match="adapter") as err:
        serve.build(args)
    assert "\n" not in str(err.value)
    with pytest.raises(serve.StartError, match="adapter_config.json"):
        serve.build(flags.parse([*args_list(tiny_model_dir, tmp_path), "--adapter-path", str(tmp_path)]))


def args_list(model: Path, tmp: Path) -> list[str]:
    return ["--model", str(model), "--no-kv-disk", "--store", str(tmp / "s.sqlite3"), "--state-key-file",
            str(tmp / "k"), "--port", "1"]
