"""Run by tests/test_distributed.py under `mlx.launch -n 2 --backend ring` (and alone, for
the reference): load a model split over the ranks (`python -m tests.distributed_probe DIR
tensor|pipeline|none`), run a 40-token prompt and 20 greedy tokens through its runner, and
print rank 0's tokens and first logits as one JSON line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lmsp_mlx.cpu_blas import accelerate

accelerate()
import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from lmsp_mlx.engine.distributed import join  # noqa: E402
from lmsp_mlx.engine.loader import LoadOptions, load_model  # noqa: E402


def main() -> None:
    path, parallel = Path(sys.argv[1]), sys.argv[2]
    ranks = None if parallel == "none" else join(parallel)
    lm = load_model(path, options=LoadOptions(ranks=ranks))
    cache = make_prompt_cache(lm.model)
    logits = lm.runner.forward(mx.array([list(range(5, 45))]), cache)[0, -1]
    first, tokens = logits, []
    for _ in range(20):
        tokens.append(int(mx.argmax(logits).item()))
        logits = lm.runner.forward(mx.array([tokens[-1:]]), cache)[0, -1]
    if ranks is None or ranks.rank == 0:
        print(json.dumps({"tokens": tokens, "first": first.tolist(), "runner": lm.runner.kind}), flush=True)


if __name__ == "__main__":
    main()
