"""The memory check before a load: the estimate from the safetensors headers is what the
loaded model then holds, and a model above the budget is refused with both figures."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from tests.tiny_model import build_tiny_moe_model

from lmsp_mlx import flags, serve
from lmsp_mlx.engine.footprint import estimate_bytes
from lmsp_mlx.engine.loader import backend_name, load_model


def loaded_bytes(path) -> int:
    return sum(v.nbytes for _, v in tree_flatten(load_model(path).model.parameters()))


def quantized_copy(model_dir, out):
    from mlx_lm.utils import load

    model, _ = load(str(model_dir))
    nn.quantize(model, group_size=32, bits=4)
    out.mkdir()
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((model_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization": {"group_size": 32, "bits": 4}}))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return out


@pytest.mark.parametrize("kind", ["float32", "4-bit", "moe"])
def test_the_estimate_is_what_the_loaded_model_holds(kind, tiny_model_dir, tmp_path):
    path = {"float32": lambda: tiny_model_dir, "4-bit": lambda: quantized_copy(tiny_model_dir, tmp_path / "q4"),
            "moe": lambda: build_tiny_moe_model(tmp_path / "moe", "qwen3_moe")}[kind]()
    config = json.loads((path / "config.json").read_text())
    assert estimate_bytes(path, config, backend_name()) == loaded_bytes(path)
    if kind == "4-bit" and backend_name() == "cpu":  # float32 on the CPU: far more than the file
        assert estimate_bytes(path, config, "cpu") > 4 * (path / "model.safetensors").stat().st_size


def test_a_model_over_the_budget_is_a_start_error_naming_both_figures(tiny_model_dir, tmp_path):
    args = flags.parse(["--model", str(tiny_model_dir), "--memory-budget-mb", "0.1", "--no-kv-disk",
                             "--store", str(tmp_path / "s.sqlite3"), "--state-key-file", str(tmp_path / "k"),
                             "--port", "1"])
    with pytest.raises(serve.StartError) as err:
        serve.build(args)
    line = str(err.value)
    assert "\n" not in line and "needs about" in line and "0.1 MiB may be used (--memory-budget-mb)" in line
