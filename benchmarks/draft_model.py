"""A draft model against none: lmsp-mlx's engine beside mlx-lm's speculative_generate_step,
on the same target/draft pair and the same float32 weights, in one process and one run.

    python -m benchmarks.draft_model [--layers 8,16,30] [--max-tokens 160] [--repeats 2]
                                     [--num-draft-tokens 4] [--out DIR] [--append]

No real target/draft pair with one tokenizer can be had offline here: the package index
ships SmolLM2-135M-Instruct's GGUF (the default model) and no larger or smaller model with
its tokenizer. So each draft model is the default model's first N layers
(`tests.tiny_model.first_layers`; the model has 30); N = 30 is the model as its own draft,
every greedy draft right, the ceiling of what drafting buys here.

For each draft, one stream, greedy, end-of-turn biased away so that replies run full
length, on an agent prompt and a prose prompt (benchmarks/speculative.py's first of each):
- `mlx-lm`: `generate_step` against `speculative_generate_step(num_draft_tokens)`, on the
  loaded float32 model objects;
- `lmsp-mlx`: the engine's `generate` without drafts against `Drafting(DraftModel)`: the
  compiled CPU step for the target and the draft, as the server runs them.
Each row has the tok/s of the decode (prompt excluded: time from the first token to the
last), the accepted share, and whether the tokens equal those without a draft. Writes
benchmarks/results/draft_model.csv with the run's provenance; prints each cell's median.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import tempfile
import time
from pathlib import Path

from lmsp_mlx.cpu_blas import accelerate

accelerate()  # first: MLX binds its BLAS as mlx.core loads (lmsp_mlx/cpu_blas/__init__.py)
import mlx.core as mx  # noqa: E402

from benchmarks.common import Provenance, output_arguments, write_rows  # noqa: E402
from benchmarks.speculative import agent_prompts, prose_prompts  # noqa: E402
from lmsp_mlx.engine.batch import generate  # noqa: E402
from lmsp_mlx.engine.generate import GenerationParams  # noqa: E402
from lmsp_mlx.engine.loader import load_model  # noqa: E402
from lmsp_mlx.engine.model_store import DEFAULT_MODEL, default_models_dir, ensure_packaged_model  # noqa: E402
from lmsp_mlx.engine.speculate import DraftModel, Drafting  # noqa: E402
from tests.tiny_model import first_layers  # noqa: E402

FIELDS = ("engine", "workload", "draft_layers", "repeat", "tokens", "decode_tok_s", "plain_tok_s", "speedup",
          "drafted", "accepted", "identical")
END_OF_TURN = 2  # <|im_end|>


def ours(lm, prompt: list[int], max_tokens: int, draft, k: int) -> tuple[list[int], float, int, int]:
    """The engine's tokens, decode tok/s, drafted and accepted."""
    stamps: list[float] = []
    tokens: list[int] = []
    drafting = None if draft is None else Drafting(k, drafter=DraftModel(draft))
    p = GenerationParams(prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    generate(lm, p, emit=lambda e: stamps.append(time.perf_counter()), sampled=tokens, drafting=drafting)
    rate = (len(tokens) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return tokens, rate, drafting.drafted if drafting else 0, drafting.accepted if drafting else 0


def peer(lm, prompt: list[int], max_tokens: int, draft, k: int) -> tuple[list[int], float, int, int]:
    """mlx-lm's tokens, decode tok/s, drafted (unknown: 0) and accepted (tokens from the draft)."""
    g = importlib.import_module("mlx_lm.generate")
    vocab = lm.vocab_size

    def no_end(_, logits):
        return logits + mx.where(mx.arange(vocab) == END_OF_TURN, -1e9, 0.0)

    common = {"max_tokens": max_tokens, "logits_processors": [no_end]}
    if draft is None:
        steps = ((t, False) for t, _ in g.generate_step(mx.array(prompt), lm.model, **common))
    else:
        steps = ((t, d) for t, _, d in g.speculative_generate_step(mx.array(prompt), lm.model, draft.model,
                                                                    num_draft_tokens=k, **common))
    tokens, stamps, accepted = [], [], 0
    for t, from_draft in steps:
        tokens.append(int(t))
        stamps.append(time.perf_counter())
        accepted += bool(from_draft)
    return tokens, (len(tokens) - 1) / (stamps[-1] - stamps[0]), 0, accepted


ENGINES = {"lmsp-mlx": ours, "mlx-lm": peer}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="8,16,30", help="draft models: the default model's first N layers")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    output_arguments(p)
    args = p.parse_args()
    provenance = Provenance.gather()
    target_dir = ensure_packaged_model(DEFAULT_MODEL, default_models_dir())
    lm = load_model(target_dir)
    folder = Path(tempfile.mkdtemp(prefix="draft-model-"))
    drafts = {n: load_model(first_layers(target_dir, folder / f"first-{n}", n)) for n in map(int, args.layers.split(","))}
    prompts = {name: lm.tokenizer.apply_chat_template([{"role": "user", "content": make(1)[0]}],
                                                      add_generation_prompt=True)
               for name, make in (("agent", agent_prompts), ("prose", prose_prompts))}
    rows = []
    for repeat in range(args.repeats):
        for engine, run in (ENGINES.items() if repeat % 2 == 0 else list(ENGINES.items())[::-1]):
            for workload, prompt in prompts.items():
                plain, plain_rate, _, _ = run(lm, prompt, args.max_tokens, None, args.num_draft_tokens)
                for n, draft in drafts.items():
                    got, rate, drafted, accepted = run(lm, prompt, args.max_tokens, draft, args.num_draft_tokens)
                    row = {"engine": engine, "workload": workload, "draft_layers": n, "repeat": repeat,
                           "tokens": len(got), "decode_tok_s": round(rate, 2), "plain_tok_s": round(plain_rate, 2),
                           "speedup": round(rate / plain_rate, 3), "drafted": drafted, "accepted": accepted,
                           "identical": got == plain}
                    rows.append(row)
                    write_rows("draft_model", [row], provenance, out=args.out, append=args.append or len(rows) > 1,
                               fields=FIELDS)
                    print(f"{engine:>8} {workload:>5} draft {n:>2} layers #{repeat}: {rate:6.1f} tok/s "
                          f"({rate / plain_rate:.2f}x of {plain_rate:.1f}), {accepted} accepted, identical "
                          f"{got == plain}", flush=True)
    print("\n| engine | workload | " + " | ".join(f"first {n} layers" for n in drafts) + " |")
    print("|---|---|" + "---:|" * len(drafts))
    for engine in ENGINES:
        for workload in prompts:
            cells = [statistics.median(r["speedup"] for r in rows if (r["engine"], r["workload"], r["draft_layers"])
                                       == (engine, workload, n)) for n in drafts]
            print(f"| {engine} | {workload} | " + " | ".join(f"{c:.2f}x" for c in cells) + " |")


if __name__ == "__main__":
    main()
