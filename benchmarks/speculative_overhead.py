"""What speculation costs where it buys nothing: decode with drafts that are refused against
decode without drafts, on one model, in one process and one run.

    python -m benchmarks.speculative_overhead [--families default,qwen3_5] [--max-tokens 160]
                                              [--repeats 3] [--out DIR] [--append]

For each model (`default`: SmolLM2-135M-Instruct in float32 on the compiled CPU step; a
family name: benchmarks/architectures.py's 60M random model of it, on the MLX runner),
one greedy stream of `--max-tokens` tokens on a prose prompt, three ways, taking turns:
- `off`: no drafts;
- `ngram`: prompt lookup as `--speculate ngram` runs it (on prose, what it drafts is
  mostly refused);
- `refused`: a drafter that drafts k tokens at every chance and is never right (the
  worst case: every draft costs rows and, on recurrent layers, a re-run), so the cost that
  is left is what `Drafting`'s pause lets through.
Each row has the decode tok/s (from the first token to the last), drafted and accepted,
and the ratio against `off` of the same repeat. Writes
benchmarks/results/speculative_overhead.csv with the run's provenance.
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
from lmsp_mlx.engine.speculate import Drafting, PromptLookup  # noqa: E402

FIELDS = ("model", "runner", "mode", "repeat", "tokens", "decode_tok_s", "ratio", "drafted", "accepted")
PROMPT = "Write a story about a lighthouse keeper who finds a map."


class Refused:
    """Drafts k copies of one token: the vocabulary's last, which no reply here takes (the
    rows' `accepted` column shows it)."""

    def __init__(self, never: int) -> None:
        self.never = never

    def draft(self, tokens: list[int], k: int) -> list[int]:
        return [self.never] * k


def decode(lm, prompt: list[int], max_tokens: int, drafting: Drafting | None) -> tuple[float, int]:
    stamps: list[float] = []
    tokens: list[int] = []
    p = GenerationParams(prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    generate(lm, p, emit=lambda e: stamps.append(time.perf_counter()), sampled=tokens, drafting=drafting)
    return (len(tokens) - 1) / (stamps[-1] - stamps[0]), len(tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="default,qwen3_5")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    output_arguments(p)
    args = p.parse_args()
    provenance = Provenance.gather()
    folder = Path(tempfile.mkdtemp(prefix="speculative-overhead-"))
    rows = []
    for family in args.families.split(","):
        if family == "default":
            lm = load_model(ensure_packaged_model(DEFAULT_MODEL, default_models_dir()))
        else:
            lm = load_model(build_benchmark_model(folder / family, family))
        prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
        drafters = {"off": lambda: None, "ngram": lambda: Drafting(args.num_draft_tokens, drafter=PromptLookup()),
                    "refused": lambda: Drafting(args.num_draft_tokens, drafter=Refused(lm.vocab_size - 1))}
        decode(lm, prompt, 8, None)  # warm-up
        for repeat in range(args.repeats):
            order = list(drafters) if repeat % 2 == 0 else list(drafters)[::-1]
            got = {}
            for mode in order:
                drafting = drafters[mode]()
                rate, n = decode(lm, prompt, args.max_tokens, drafting)
                got[mode] = (rate, n, drafting.drafted if drafting else 0, drafting.accepted if drafting else 0)
            for mode, (rate, n, drafted, accepted) in got.items():
                row = {"model": family, "runner": lm.runner.kind, "mode": mode, "repeat": repeat, "tokens": n,
                       "decode_tok_s": round(rate, 2), "ratio": round(rate / got["off"][0], 3),
                       "drafted": drafted, "accepted": accepted}
                rows.append(row)
                write_rows("speculative_overhead", [row], provenance, out=args.out,
                           append=args.append or len(rows) > 1, fields=FIELDS)
                print(f"{family:>8} {mode:>7} #{repeat}: {rate:6.1f} tok/s ({row['ratio']:.3f}x off), "
                      f"{accepted}/{drafted} accepted", flush=True)
    print("\n| model | runner | ngram ÷ off | refused ÷ off |")
    print("|---|---|---:|---:|")
    for family in args.families.split(","):
        mine = [r for r in rows if r["model"] == family]
        med = {m: statistics.median(r["ratio"] for r in mine if r["mode"] == m) for m in ("ngram", "refused")}
        print(f"| {family} | {mine[0]['runner']} | {med['ngram']:.3f} | {med['refused']:.3f} |")


if __name__ == "__main__":
    main()
