"""Speculative decoding by prompt lookup against none, on the same server build, in one run.

    python -m benchmarks.speculative [--widths 1,4,8] [--max-tokens 160] [--repeats 2]
                                     [--family qwen3_5] [--out DIR] [--append]

Two lmsp-mlx servers take turns (a fresh one each time, `--speculate off` and `--speculate
ngram`, the order swapped every repeat), on the default model (SmolLM2-135M-Instruct in
float32, the compiled CPU step) or with `--family` on a random 60M model of that family
(benchmarks/architectures.py's sizes; the MLX runner). At each width W, W clients stream
greedy chat replies of `--max-tokens` tokens at once (end-of-turn biased away, so replies
run full length) for two workloads:

- `agent`: replies that quote their context: a Python file rewritten with one name
  changed, a JSON document echoed with one field changed, a tool call's arguments re-sent;
- `prose`: stories, where the reply has little to copy.

Each row has the aggregate tok/s, the drafted and accepted tokens (from /metrics), and
whether every reply was the one the server without speculation gave. Writes
benchmarks/results/speculative.csv (or speculative_<family>.csv) with the run's provenance
and prints each cell's median ratio, ngram over off.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lmsp_mlx.cpu_blas import accelerate

accelerate()  # first: MLX binds its BLAS as mlx.core loads (lmsp_mlx/cpu_blas/__init__.py)
import httpx  # noqa: E402

from benchmarks.common import (Provenance, output_arguments, own_state, server_command, serving, sse_events,  # noqa: E402
                               write_rows)

MODES = ("off", "ngram")
FIELDS = ("model", "workload", "width", "mode", "repeat", "output_tokens", "wall_s", "aggregate_tok_s", "drafted",
          "accepted", "identical", "errors")

SOURCE = '''import math


def area(radius: float) -> float:
    """The area of a circle of this radius."""
    return math.pi * radius * radius


def ring(outer: float, inner: float) -> float:
    """The area between two circles with one centre."""
    if inner > outer:
        raise ValueError("the inner radius is larger than the outer one")
    return area(outer) - area(inner)


def report(radii: list[float]) -> str:
    lines = [f"{r:8.2f} {area(r):12.3f}" for r in radii]
    return "\\n".join(lines)
'''

DOCUMENT = '''{
  "id": "order-{i}",
  "status": "open",
  "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "city": "London"},
  "items": [
    {"sku": "A-100", "name": "notebook", "quantity": 3, "price": 4.5},
    {"sku": "B-220", "name": "pencil", "quantity": 12, "price": 0.8},
    {"sku": "C-310", "name": "ruler", "quantity": 1, "price": 2.25}
  ],
  "shipping": {"method": "standard", "days": 5},
  "notes": "leave at the door"
}'''

ARGUMENTS = ('{"path": "src/app/handlers/orders.py", "old_string": "def handle(order):\\n    return order.total", '
             '"new_string": "def handle(order):\\n    check(order)\\n    return order.total", "replace_all": false}')

TOPICS = ("a lighthouse keeper who finds a map", "a city where it never stops raining", "the last train of the night",
          "a dog that learns to read", "two rival bakers", "a garden on the moon", "a forgotten violin",
          "a storm at sea")


def agent_prompts(width: int) -> list[str]:
    """Replies that quote their context, each client's its own (a number differs)."""
    out = []
    for i in range(width):
        kind = i % 3
        if kind == 0:
            out.append(f"Here is the file circles_{i}.py:\n\n```python\n{SOURCE}```\n\nRewrite the whole file with "
                       "the function `area` renamed to `surface` everywhere. Reply with the complete file only.")
        elif kind == 1:
            out.append(f"Here is a JSON document:\n\n{DOCUMENT.replace('{i}', str(1000 + i))}\n\nReturn the same "
                       'document with "status" set to "shipped". Reply with the complete JSON only.')
        else:
            out.append(f"The tool call edit_file failed with a timeout. Its arguments were:\n\n{ARGUMENTS}\n\n"
                       f"Send call {i} again with exactly the same arguments, as a JSON object.")
    return out


def prose_prompts(width: int) -> list[str]:
    return [f"Write a story about {TOPICS[i % len(TOPICS)]}." for i in range(width)]


WORKLOADS = {"agent": agent_prompts, "prose": prose_prompts}


def stream(client: httpx.Client, model: str, prompt: str, max_tokens: int, bias: dict[str, float]) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": max_tokens, "temperature": 0,
            "logit_bias": bias}
    sent, text, usage, error = time.perf_counter(), [], None, None
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            for _, chunk in sse_events(r.iter_lines()):
                if isinstance(chunk, dict):
                    for choice in chunk.get("choices") or []:
                        text.append((choice.get("delta") or {}).get("content") or "")
                    usage = chunk.get("usage") or usage
    except Exception as exc:  # noqa: BLE001 - counted, the run goes on
        error = f"{type(exc).__name__}: {exc}"
    return {"sent": sent, "done": time.perf_counter(), "text": "".join(text),
            "tokens": (usage or {}).get("completion_tokens", 0), "error": error}


def drafts(url: str) -> tuple[int, int]:
    """(drafted, accepted) tokens so far, from /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text

    def total(name: str) -> int:
        return sum(int(m.group(1)) for m in re.finditer(rf"^{name}{{[^}}]*}} (\d+)$", text, re.MULTILINE))

    return total("lmsp_speculative_drafted_tokens_total"), total("lmsp_speculative_accepted_tokens_total")


def run_cell(url: str, model: str, prompts: list[str], max_tokens: int, bias: dict[str, float]) -> dict:
    before = drafts(url)
    with httpx.Client(base_url=url, timeout=600) as client, ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: stream(client, model, p, max_tokens, bias), prompts))
    after = drafts(url)
    wall = max(r["done"] for r in results) - min(r["sent"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {"output_tokens": tokens, "wall_s": wall, "aggregate_tok_s": tokens / wall,
            "drafted": after[0] - before[0], "accepted": after[1] - before[1],
            "errors": sum(bool(r["error"]) for r in results), "texts": [r["text"] for r in results]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="1,4,8")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeats", type=int, default=2, help="server pairs; the table shows each cell's median")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--family", help="a random model of this family (tests/tiny_model.py FAMILIES) instead of the "
                                    "default model")
    output_arguments(p)
    args = p.parse_args()
    provenance = Provenance.gather()
    widths = [int(w) for w in args.widths.split(",")]
    folder = Path(tempfile.mkdtemp(prefix="speculative-"))
    model_args, label, bias = [], "SmolLM2-135M-Instruct", {"2": -100.0}  # <|im_end|>
    if args.family:
        from benchmarks.architectures import EOS, build_benchmark_model

        model_args = ["--model", str(build_benchmark_model(folder / args.family, args.family)), "--model-id", "bench"]
        label, bias = args.family, {str(i): -100.0 for i in EOS}
    name = "speculative" + (f"_{args.family}" if args.family else "")
    rows, reference = [], {}
    for repeat in range(args.repeats):
        for mode in (MODES if repeat % 2 == 0 else MODES[::-1]):
            run_dir = folder / f"{mode}-r{repeat}"
            run_dir.mkdir()
            cmd = server_command("lmsp-mlx", *model_args, *own_state(run_dir, kv_disk=False),
                                 "--max-batch", max(widths), "--speculate", mode,
                                 "--num-draft-tokens", args.num_draft_tokens)
            with serving(cmd, run_dir / "server.log") as server:
                model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
                run_cell(server.url, model, prose_prompts(1), 8, bias)  # warm-up
                for workload, make in WORKLOADS.items():
                    for width in widths:
                        cell = run_cell(server.url, model, make(width), args.max_tokens, bias)
                        key = (workload, width)
                        if mode == "off" and key not in reference:
                            reference[key] = cell["texts"]
                        row = {"model": label, "workload": workload, "width": width, "mode": mode, "repeat": repeat,
                               **{k: v for k, v in cell.items() if k != "texts"},
                               "identical": cell["texts"] == reference.get(key, cell["texts"])}
                        rows.append(row)
                        write_rows(name, [{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}],
                                   provenance, out=args.out, append=args.append or len(rows) > 1, fields=FIELDS)
                        print(f"{workload:>6} W={width} {mode:>5} #{repeat}: {row['aggregate_tok_s']:7.1f} tok/s, "
                              f"{row['accepted']}/{row['drafted']} drafted accepted, identical {row['identical']}",
                              flush=True)
    table(rows, widths)


def table(rows: list[dict], widths: list[int]) -> None:
    def median(workload: str, width: int, mode: str) -> float:
        return statistics.median(r["aggregate_tok_s"] for r in rows
                                 if (r["workload"], r["width"], r["mode"]) == (workload, width, mode))

    print("\n| workload | " + " | ".join(f"W={w} off / ngram (tok/s)" for w in widths) + " |")
    print("|---|" + "---:|" * len(widths))
    for workload in WORKLOADS:
        cells = []
        for w in widths:
            off, on = median(workload, w, "off"), median(workload, w, "ngram")
            accepted = sum(r["accepted"] for r in rows if (r["workload"], r["width"], r["mode"]) == (workload, w, "ngram"))
            drafted = sum(r["drafted"] for r in rows if (r["workload"], r["width"], r["mode"]) == (workload, w, "ngram"))
            cells.append(f"{off:.1f} / {on:.1f} ({on / off:.2f}x, {accepted}/{drafted} accepted)")
        print(f"| {workload} | " + " | ".join(cells) + " |")
    print(f"\nevery reply identical to the one without speculation: {all(r['identical'] for r in rows)}")


if __name__ == "__main__":
    main()
