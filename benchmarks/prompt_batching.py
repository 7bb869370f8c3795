"""Short prompts that arrive at once: prefilled in one forward against one by one, in one run.

    python -m benchmarks.prompt_batching [--families llama,qwen3_next,gpt_oss,deepseek_v3]
                                         [--prompts 8] [--prompt-words 50] [--rounds 3] [--out DIR] [--append]

Each family (tests/tiny_model.py, widened as benchmarks/architectures.py widens them:
tens of millions of parameters, float32, the MLX path: `LMSP_CPU_DECODE=0` and
`LMSP_CPU_PREFILL=0`) is served
twice: as shipped, and with `LMSP_PREFILL_TOGETHER=0` (each prompt prefilled alone, one
per step, as before). In each round `--prompts` clients send chat prompts of
`--prompt-words` words at once (about 220 tokens: short prompts, one chunk each; new text
each round: no cache hits) and stream 16 tokens. Reported per server: the median over
rounds of the mean and the last time to first token, and of the wall time. Writes
benchmarks/results/prompt_batching.csv (with the run's provenance) and prints a Markdown
table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from lmsp_mlx.cpu_blas import accelerate

accelerate()  # first: MLX binds its BLAS as mlx.core loads (lmsp_mlx/cpu_blas/__init__.py)
from benchmarks.architectures import build_benchmark_model  # noqa: E402
from benchmarks.common import Provenance, output_arguments, own_state, server_command, serving, write_rows  # noqa: E402
from benchmarks.concurrency import measure  # noqa: E402

WORDS = "the river town kept its records in a stone house by the bridge and every spring".split()
MODES = {"together": "1", "one by one": "0"}


def prompts(n: int, tokens: int, round_: int) -> list[tuple[int, list[dict]]]:
    """`n` chat prompts of about `tokens` words, each its own text (round and index first)."""
    out = []
    for i in range(n):
        words = [WORDS[(7 * j + i + round_) % len(WORDS)] for j in range(tokens)]
        out.append((tokens, [{"role": "user", "content": f"Round {round_}, note {i}: " + " ".join(words)}]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="llama,qwen3_next,gpt_oss,deepseek_v3")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-words", type=int, default=50, help="words a prompt holds (about 220 tokens)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0)
    output_arguments(p)
    args = p.parse_args()
    provenance = Provenance.gather()
    folder = Path(tempfile.mkdtemp(prefix="prompt-batching-"))
    rows: list[dict] = []
    for family in args.families.split(","):
        model_dir = build_benchmark_model(folder / family, family)
        for mode, switch in MODES.items():
            run_dir = folder / f"{family}-{mode.replace(' ', '-')}"
            run_dir.mkdir()
            os.environ.update(LMSP_CPU_DECODE="0", LMSP_CPU_PREFILL="0", LMSP_PREFILL_TOGETHER=switch)  # inherited
            cmd = server_command("lmsp-mlx", "--model", model_dir, "--model-id", "bench",
                                 *own_state(run_dir, kv_disk=False), "--max-batch", args.prompts)
            rounds = []
            with serving(cmd, run_dir / "server.log") as server:
                measure(server.url, "bench", prompts(1, 8, -1), 1, 4, {}, args.timeout)  # warm-up
                for r in range(args.rounds):
                    got = measure(server.url, "bench", prompts(args.prompts, args.prompt_words, r), args.prompts,
                                  16, {}, args.timeout)
                    ttft = [g["ttft_s"] for g in got if g["ttft_s"] is not None and not g["error"]]
                    wall = max(g["done"] for g in got) - min(g["sent"] for g in got)
                    rounds.append((statistics.mean(ttft), max(ttft), wall, sum(bool(g["error"]) for g in got)))
                batched = (run_dir / "server.log").read_text().count("prompts in one forward")
            row = {"family": family, "mode": mode, "prompts": args.prompts, "prompt_words": args.prompt_words,
                   "ttft_mean_s": round(statistics.median(r[0] for r in rounds), 3),
                   "ttft_last_s": round(statistics.median(r[1] for r in rounds), 3),
                   "wall_s": round(statistics.median(r[2] for r in rounds), 3),
                   "batched_prefills": batched, "errors": sum(r[3] for r in rounds)}
            rows.append(row)
            print(f"{family:>12} {mode:>10}: first tokens mean {row['ttft_mean_s']:.2f} s, last "
                  f"{row['ttft_last_s']:.2f} s, wall {row['wall_s']:.2f} s ({batched} batched prefills)", flush=True)
    os.environ.pop("LMSP_PREFILL_TOGETHER")
    write_rows("prompt_batching", rows, provenance, out=args.out, append=args.append)
    print("\n| family | first token, mean: together / one by one | last: together / one by one | wall |")
    print("|---|---:|---:|---:|")
    for family in dict.fromkeys(r["family"] for r in rows):
        a, b = (next(r for r in rows if r["family"] == family and r["mode"] == m) for m in MODES)
        print(f"| {family} | {a['ttft_mean_s']:.2f} / {b['ttft_mean_s']:.2f} s ({b['ttft_mean_s'] / a['ttft_mean_s']:.2f}x) "
              f"| {a['ttft_last_s']:.2f} / {b['ttft_last_s']:.2f} s ({b['ttft_last_s'] / a['ttft_last_s']:.2f}x) "
              f"| {a['wall_s']:.2f} / {b['wall_s']:.2f} s |")


if __name__ == "__main__":
    main()
