"""What a sequence joining or leaving a merged batch costs the step it happens in, on the MLX path.

    python -m benchmarks.batch_joins [--sequences 8] [--context 4096] [--steps 7] [--out DIR] [--append]

A random float32 llama (8 layers of width 768, the compiled CPU step not installed: the
path a Mac runs) decodes `--sequences` sequences whose KV caches hold `--context`
positions each, merged into one batch (engine/batch.py `Merged`). Measured in one run, as
medians of `--steps` steps each:

- steady: a step whose members stay the same;
- leave: a step right after one member left (`Merged.release`: its row extracted, the
  batch filtered);
- join: a step in which one sequence joins (merged alone, the batch extended);
- after: the steady step that follows, on the filtered and extended cache;
- rebuild: for comparison, a step after every member was extracted and merged again, which
  is what a change of members cost before joins and leaves touched only their own row.

The caches are filled with random keys and values rather than prefilled: a decode step's
cost depends on how many positions it reads, not on their values. Writes
benchmarks/results/batch_joins.csv with the run's provenance and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

from lmsp_mlx.cpu_blas import accelerate

accelerate()  # first: MLX binds its BLAS as mlx.core loads (lmsp_mlx/cpu_blas/__init__.py)
import mlx.core as mx  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import KVCache, make_prompt_cache  # noqa: E402

from benchmarks.common import Provenance, output_arguments, write_rows  # noqa: E402
from lmsp_mlx.engine.batch import Merged  # noqa: E402

CONFIG = {"model_type": "llama", "hidden_size": 768, "num_hidden_layers": 8, "intermediate_size": 2048,
          "num_attention_heads": 12, "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "vocab_size": 32000,
          "rope_theta": 10000.0, "tie_word_embeddings": False}


@dataclass(eq=False)
class Member:
    """What `Merged` reads of a sequence: its pending token and its own cache list."""

    cache: list
    pending: list[int] = field(default_factory=lambda: [1])


def filled(model, context: int) -> list[KVCache]:
    cache = make_prompt_cache(model)
    heads, dim = CONFIG["num_key_value_heads"], CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
    for c in cache:
        c.update_and_fetch(mx.random.normal((1, heads, context, dim)), mx.random.normal((1, heads, context, dim)))
    mx.eval([c.state for c in cache])
    return cache


def timed(step) -> float:
    start = time.perf_counter()
    mx.eval(step())
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=7, help="steps measured per kind (their median is reported)")
    output_arguments(p)
    args = p.parse_args()
    provenance = Provenance.gather()

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(CONFIG))
    mx.eval(model.parameters())
    members = [Member(filled(model, args.context)) for _ in range(args.sequences)]
    merged = Merged()
    step = lambda seqs: lambda: merged.step(model, seqs)  # noqa: E731
    timed(step(members))  # the first merge, and warm-up
    timed(step(members))

    times: dict[str, list[float]] = {"steady": [], "leave": [], "join": [], "after": [], "rebuild": []}
    for _ in range(args.steps):
        times["steady"].append(timed(step(members)))
        times["leave"].append(timed(lambda: (merged.release(members[-1]), step(members[:-1])())[1]))
        times["join"].append(timed(step(members)))  # the one that left joins again
        times["after"].append(timed(step(members)))  # a steady step again, on the filtered and extended cache
        # The same members, every cache extracted and merged again, as any change used to.
        times["rebuild"].append(timed(lambda: (merged.release_all(), step(members)())[1]))

    steady = statistics.median(times["steady"])
    rows = [{"sequences": args.sequences, "context": args.context, "step": kind,
             "median_ms": round(1000 * statistics.median(ts), 2),
             "vs_steady": round(statistics.median(ts) / steady, 3)} for kind, ts in times.items()]
    write_rows("batch_joins", rows, provenance, out=args.out, append=args.append)
    print(f"\n{args.sequences} sequences of {args.context} positions, llama 8x768 float32 through MLX, "
          f"medians of {args.steps} steps ({provenance.machine}, mlx {provenance.mlx_version}, {provenance.commit})\n")
    print("| step | ms | vs a steady step |\n|---|---:|---:|")
    for r in rows:
        print(f"| {r['step']} | {r['median_ms']} | {r['vs_steady']} |")


if __name__ == "__main__":
    main()
