"""Every family's batched decode against mlx_lm.server, on the path a Mac runs, in one run.

    python -m benchmarks.architectures [--families llama,gpt_oss,...] [--widths 1,4,8,16]
                                       [--max-tokens 128] [--repeats 3] [--out DIR] [--append]
    python -m benchmarks.architectures --from-csv benchmarks/results/architectures.csv

Each family of tests/tiny_model.py (`FAMILIES`: llama, qwen3_next, qwen3_5, gpt_oss,
gemma3_text, nemotron_h, kimi_linear, deepseek_v3) is built with mlx-lm's own classes,
random weights in float32, widened to tens of millions of parameters (4 layers of width
1024; the parameter count is in each row). At each width W, W clients stream chat
completions of `--max-tokens` tokens each at once (end-of-turn tokens biased away, so
replies run full length) from:

- lmsp-mlx with `--max-batch W`;
- mlx_lm.server with `--decode-concurrency W --prompt-concurrency W`, given lmsp-mlx's CPU
  math (benchmarks/common.py MLX_LM_WRAPPER).

`LMSP_CPU_DECODE=0` and `LMSP_CPU_PREFILL=0` for both: llama runs through MLX, as on a
Mac, not the compiled CPU passes.
With `--repeats N` every cell is measured N times, the two servers taking turns to go
first (a fresh server each time), and the table shows each cell's median: one run on two
shared cores moves a cell by 10-20%, more than the differences it is there to show.

Writes benchmarks/results/architectures.csv (one row per measurement, with the run's
provenance) and architectures.png, and prints a Markdown table with each width's median
ratio to the peer and each server's 8-stream aggregate over its single stream.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from lmsp_mlx.cpu_blas import accelerate

accelerate()  # first: MLX binds its BLAS as mlx.core loads (lmsp_mlx/cpu_blas/__init__.py)
from benchmarks.common import Provenance, output_arguments, read_rows, serving, write_rows  # noqa: E402
from benchmarks.concurrency import SERVERS, command, measure, summarize  # noqa: E402
from tests.tiny_model import ENDLESS, FAMILIES, build_tiny_family_model  # noqa: E402

SIZES = {"hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16, "num_key_value_heads": 4,
         "head_dim": 64, "moe_intermediate_size": 1024}
# Sizes a family takes from keys of its own: Nemotron-H's Mamba mixers (at SIZES alone the
# model has 12M parameters, below the 60-200M the benchmark compares at).
FAMILY_SIZES = {
    "nemotron_h": {"hybrid_override_pattern": ["M", "-", "M", "*", "-", "M", "-", "M"], "num_hidden_layers": 8,
                   "mamba_num_heads": 32, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8},
}
FIELDS = ("family", "parameters", "server", "width", "repeat", "output_tokens", "wall_s", "aggregate_tok_s",
          "ttft_p50_s", "requests", "short_replies", "errors")
EOS = (0, 2)  # <|endoftext|> and <|im_end|> in tests/tiny_model.py's tokenizer


def build_benchmark_model(out: Path, family: str) -> Path:
    """tests/tiny_model.py's `family`, widened to the benchmark's sizes (60-200M parameters)."""
    return build_tiny_family_model(out, family, **SIZES, **FAMILY_SIZES.get(family, {}))


def parameters(model_dir: Path) -> int:
    import mlx.core as mx

    return sum(a.size for a in mx.load(str(model_dir / "model.safetensors")).values())


def prompts(width: int, tag: str = "") -> list[tuple[int, list[dict]]]:
    """One short prompt per client (about 20 tokens: decode-heavy work), each different from
    its first token on; `tag` keeps the warm-up's apart, so that no server reuses its KV."""
    return [(20, [{"role": "user", "content": f"{tag}{i + 1}. {ENDLESS}"}]) for i in range(width)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--widths", default="1,4,8,16")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--repeats", type=int, default=1, help="measurements of each cell; the table shows the median")
    p.add_argument("--from-csv", type=Path, help="no run: the table and PNG of a CSV this benchmark wrote")
    output_arguments(p)
    args = p.parse_args()
    if args.from_csv:
        rows = read_rows(args.from_csv)
        plot(rows, args.out / "architectures.png")
        table(rows, sorted({r["width"] for r in rows}))
        return
    provenance = Provenance.gather()
    os.environ.update(LMSP_CPU_DECODE="0", LMSP_CPU_PREFILL="0")  # both servers inherit them: the MLX path, as on a Mac
    widths = [int(w) for w in args.widths.split(",")]
    folder = Path(tempfile.mkdtemp(prefix="architectures-"))
    bias = {str(i): -100.0 for i in EOS}
    rows: list[dict] = []
    for family in args.families.split(","):
        model_dir = build_benchmark_model(folder / family, family)
        count = parameters(model_dir)
        for width in widths:
            for repeat in range(args.repeats):
                for name in taking_turns(repeat):
                    run_dir = folder / f"{family}-{name}-w{width}-r{repeat}"
                    run_dir.mkdir()
                    cmd, model = command(name, model_dir, width, run_dir)
                    with serving(cmd, run_dir / "server.log") as server:
                        measure(server.url, model, prompts(1, "warm-up "), 1, 8, bias, args.timeout)
                        row = summarize(name, width, measure(server.url, model, prompts(width), width,
                                                             args.max_tokens, bias, args.timeout), args.max_tokens)
                    row = {"family": family, "parameters": count, "repeat": repeat,
                           **{k: row[k] for k in FIELDS if k in row}}
                    rows.append(row)
                    write_rows("architectures",
                               [{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}],
                               provenance, out=args.out, append=args.append or len(rows) > 1, fields=FIELDS)
                    print(f"{family:>12} {name:>14} width {width:2d} #{repeat}: {row['aggregate_tok_s']:7.1f} tok/s "
                          f"({row['output_tokens']} tokens, {row['errors']} errors)", flush=True)
    try:
        plot(rows, args.out / "architectures.png")
    except ImportError:
        print("(no matplotlib: CSV only; pip install -e '.[bench]')")
    table(rows, widths)


def taking_turns(repeat: int) -> tuple[str, ...]:
    """The servers' order in one measurement: each goes first in every other one, so that
    neither always meets the machine warmer or cooler."""
    return SERVERS if repeat % 2 == 0 else SERVERS[::-1]


def medians(rows: list[dict]) -> dict[tuple[str, str, int], float]:
    """Each (family, server, width) cell's median aggregate over its measurements."""
    cells: dict[tuple[str, str, int], list[float]] = {}
    for r in rows:
        cells.setdefault((r["family"], r["server"], r["width"]), []).append(r["aggregate_tok_s"])
    return {cell: statistics.median(values) for cell, values in cells.items()}


def table(rows: list[dict], widths: list[int]) -> None:
    by = medians(rows)
    families = list(dict.fromkeys(r["family"] for r in rows))
    print("\n| family | parameters | " + " | ".join(f"W={w} lmsp-mlx / mlx_lm.server (tok/s)" for w in widths)
          + " | 8 vs 1 stream, lmsp-mlx | 8 vs 1, mlx_lm.server |")
    print("|---|---:|" + "---:|" * (len(widths) + 2))
    for f in families:
        count = next(r["parameters"] for r in rows if r["family"] == f)
        cells = [f"{by[(f, 'lmsp-mlx', w)]:.1f} / {by[(f, 'mlx_lm.server', w)]:.1f} "
                 f"({ratio(by[(f, 'lmsp-mlx', w)], by[(f, 'mlx_lm.server', w)])})" for w in widths]
        scale = [ratio(by[(f, s, 8)], by[(f, s, 1)]) if (f, s, 8) in by and (f, s, 1) in by else "-"
                 for s in SERVERS]
        print(f"| {f} | {count / 1e6:.0f}M | " + " | ".join(cells) + " | " + " | ".join(scale) + " |")


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "-"


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.plots import save

    by = medians(rows)
    families = list(dict.fromkeys(r["family"] for r in rows))
    fig, axes = plt.subplots(1, len(families), figsize=(3 * len(families), 3), squeeze=False)
    for ax, family in zip(axes[0], families):
        for name, marker in zip(SERVERS, "os"):
            pts = sorted((w, v) for (f, s, w), v in by.items() if f == family and s == name)
            ax.plot(*zip(*pts), marker=marker, label=name)
        ax.set_title(family)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("streams")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("aggregate tok/s")
    axes[0][0].legend()
    save(fig, "decode, lmsp-mlx against mlx_lm.server (MLX path, float32, medians)", out)


if __name__ == "__main__":
    main()
