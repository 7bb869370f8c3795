"""What token logprobs cost in decode: one greedy stream with `top_logprobs` 5, with 0
(the sampled token's alone), and without logprobs, on one model, in one process and run.

    python -m benchmarks.logprobs [--families default,qwen3_5] [--max-tokens 160]
                                  [--repeats 3] [--out DIR] [--append]

For each model (`default`: SmolLM2-135M-Instruct in float32 on the compiled CPU step; a
family name: benchmarks/architectures.py's 60M random model of it, on the MLX runner), the
three ways take turns within each repeat. Each row has the decode tok/s (from the first
token to the last) and its ratio to `off` of the same repeat. Writes
benchmarks/results/logprobs.csv with the run's provenance.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from lmsp_mlx.cpu_blas import accelerate

accelerate()  # first: MLX binds its BLAS as mlx.core loads (lmsp_mlx/cpu_blas/__init__.py)

from benchmarks.architectures import build_benchmark_model  # noqa: E402
from benchmarks.common import Provenance, output_arguments, write_rows  # noqa: E402
from lmsp_mlx.engine.batch import generate  # noqa: E402
from lmsp_mlx.engine.generate import GenerationParams  # noqa: E402
from lmsp_mlx.engine.loader import load_model  # noqa: E402
from lmsp_mlx.engine.model_store import DEFAULT_MODEL, default_models_dir, ensure_packaged_model  # noqa: E402

FIELDS = ("model", "runner", "mode", "repeat", "tokens", "decode_tok_s", "ratio")
PROMPT = "Write a story about a lighthouse keeper who finds a map."
MODES = {"off": None, "logprobs": 0, "top5": 5}


def decode(lm, prompt: list[int], max_tokens: int, logprobs: int | None) -> tuple[float, int]:
    stamps: list[float] = []
    tokens: list[int] = []
    p = GenerationParams(prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs,
                         speculate=False)
    generate(lm, p, emit=lambda e: stamps.append(time.perf_counter()), sampled=tokens)
    return (len(tokens) - 1) / (stamps[-1] - stamps[0]), len(tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="default,qwen3_5")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeats", type=int, default=3)
    output_arguments(p)
    args = p.parse_args()
    provenance = Provenance.gather()
    folder = Path(tempfile.mkdtemp(prefix="logprobs-"))
    rows = []
    for family in args.families.split(","):
        if family == "default":
            lm = load_model(ensure_packaged_model(DEFAULT_MODEL, default_models_dir()))
        else:
            lm = load_model(build_benchmark_model(folder / family, family))
        prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
        decode(lm, prompt, 8, 5)  # warm-up
        for repeat in range(args.repeats):
            order = list(MODES) if repeat % 2 == 0 else list(MODES)[::-1]
            got = {mode: decode(lm, prompt, args.max_tokens, MODES[mode]) for mode in order}
            for mode, (rate, n) in got.items():
                row = {"model": family, "runner": lm.runner.kind, "mode": mode, "repeat": repeat, "tokens": n,
                       "decode_tok_s": round(rate, 2), "ratio": round(rate / got["off"][0], 3)}
                rows.append(row)
                write_rows("logprobs", [row], provenance, out=args.out, append=args.append or len(rows) > 1,
                           fields=FIELDS)
                print(f"{family:>8} {mode:>8} #{repeat}: {rate:6.1f} tok/s ({row['ratio']:.3f}x off)", flush=True)
    print("\n| model | runner | logprobs ÷ off | top 5 ÷ off |")
    print("|---|---|---:|---:|")
    for family in args.families.split(","):
        mine = [r for r in rows if r["model"] == family]
        med = {m: statistics.median(r["ratio"] for r in mine if r["mode"] == m) for m in ("logprobs", "top5")}
        print(f"| {family} | {mine[0]['runner']} | {med['logprobs']:.3f} | {med['top5']:.3f} |")


if __name__ == "__main__":
    main()
