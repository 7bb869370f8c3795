"""One model over two ranks that `mlx.launch -n 2 --backend ring` starts on loopback
(engine/distributed.py), against the same model in one process on the MLX runner.

Tolerance: pipeline parallelism keeps each layer's math whole on one rank, so its logits
are bitwise one process's. Tensor parallelism sums each layer's partial products over the
ranks (all_sum), a different order of addition: its logits may differ by rounding, here
at most 1e-4 on logits of size ~10, and its greedy tokens are the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_model import build_tiny_family_model

ROOT = Path(__file__).resolve().parent.parent
MLX_RUNNER = {"LMSP_CPU_DECODE": "0", "LMSP_CPU_PREFILL": "0"}  # the runner every rank gets


def probe(model: Path, parallel: str) -> dict:
    """tests/distributed_probe.py's rank-0 line: alone for "none", else over 2 ranks."""
    program = [sys.executable, "-m", "tests.distributed_probe", str(model), parallel]
    env = {**os.environ, **MLX_RUNNER, "PYTHONPATH": str(ROOT)}
    if parallel != "none":
        launch = Path(sys.executable).parent / "mlx.launch"
        program = [str(launch), "-n", "2", "--backend", "ring", *(f"--env={k}={v}" for k, v in MLX_RUNNER.items()),
                   f"--env=PYTHONPATH={ROOT}", "--", *program]
    done = subprocess.run(program, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout
    return json.loads(lines[0])


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def family_model(request, tmp_path_factory) -> Path:
    """llama (no pipeline in mlx-lm: ours, LayerPipeline) and qwen3_5 (mlx-lm's PipelineMixin,
    recurrent layers), both with tensor-parallel sharding in mlx-lm."""
    return build_tiny_family_model(tmp_path_factory.mktemp(request.param) / request.param, request.param)


def test_pipeline_parallel_gives_one_process_logits_bitwise(family_model):
    alone, split = probe(family_model, "none"), probe(family_model, "pipeline")
    assert alone["runner"] == split["runner"] == "mlx"
    assert split["tokens"] == alone["tokens"]
    assert split["first"] == alone["first"]


def test_tensor_parallel_gives_one_process_tokens_within_rounding(family_model):
    alone, split = probe(family_model, "none"), probe(family_model, "tensor")
    assert split["tokens"] == alone["tokens"]
    assert max(abs(a - b) for a, b in zip(alone["first"], split["first"])) < 1e-4
