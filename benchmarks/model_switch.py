"""Switching models on one server: unload + load of the default model, and a switched-back
session's time to first token from its checkpoint against its cold prefill.

    python -m benchmarks.model_switch [--prompt-words 600] [--rounds 3] [--out DIR] [--append]

One `python -m lmsp_mlx.serve --model <default> --model <second> --max-loaded-models 1`:
each round sends a fresh long conversation to the default model (its cold prefill), then
one request to a second model (which evicts the default, its KV sessions checkpointed),
then the first conversation's next turn to the default model again (it is loaded again
and its session restored from the checkpoint). Times to first token are the client's
(streamed); load and unload times are the server's log lines. The second model is the
default's own directory under another name, so both loads cost the same.
Writes benchmarks/results/model_switch.csv (with the run's provenance columns; `--append`
adds to its history) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import Provenance, output_arguments, own_state, server_command, serving, sse_events, write_rows
from lmsp_mlx.engine.model_store import DEFAULT_MODEL, default_models_dir, ensure_packaged_model


def ttft(url: str, model: str, messages: list[dict]) -> tuple[float, dict]:
    """Seconds to the first output delta, and the final usage."""
    began, first, usage = time.perf_counter(), None, {}
    body = {"model": model, "input": messages, "stream": True, "max_output_tokens": 8, "temperature": 0}
    with httpx.stream("POST", url + "/lmsp/v1/responses", json=body, timeout=600) as r:
        for _, event in sse_events(r.iter_lines()):
            if first is None and event["type"].endswith(".delta"):
                first = time.perf_counter() - began
            if "usage" in event and event["usage"]:
                usage = event["usage"]
    return first if first is not None else time.perf_counter() - began, usage


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompt-words", type=int, default=600)
    p.add_argument("--rounds", type=int, default=3)
    output_arguments(p)
    args = p.parse_args()
    provenance = Provenance.gather()
    default = ensure_packaged_model(DEFAULT_MODEL, default_models_dir())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        second = Path(tmp) / "second"
        shutil.copytree(default, second)
        log = Path(tmp) / "server.log"
        cmd = server_command("lmsp-mlx", "--model", default, "--model", second, "--max-loaded-models", "1",
                             "--keep-alive", "-1", *own_state(Path(tmp), kv_disk=True), "--models-dir", f"{tmp}/models")
        with serving(cmd, log, ready="/healthz") as server:
            url = server.url
            name = default.name
            for i in range(args.rounds):
                words = " ".join(f"fact{i}-{k} is worth remembering." for k in range(args.prompt_words // 4))
                first = [{"role": "user", "content": f"Round {i}. Read this: {words} Now say OK."}]
                cold, usage = ttft(url, name, first)
                ttft(url, "second", [{"role": "user", "content": "Hello"}])  # evicts the default model
                turn = first + [{"role": "assistant", "content": "OK"}, {"role": "user", "content": "And again?"}]
                back, back_usage = ttft(url, name, turn)
                text = log.read_text()
                loads = [float(x) for x in re.findall(rf"model {re.escape(name)}: loaded in ([0-9.]+) s", text)]
                unloads = [float(x) for x in re.findall(rf"model {re.escape(name)}: unloaded, evicted for second "
                                                         r"\(KV sessions checkpointed; ([0-9.]+) s\)", text)]
                rows.append({"round": i, "prompt_tokens": usage["input_tokens"], "cold_ttft_s": round(cold, 3),
                             "unload_s": unloads[-1], "load_s": loads[-1],
                             "back_ttft_s": round(back, 3), "back_ttft_less_load_s": round(back - loads[-1], 3),
                             "back_cached_tokens": back_usage["input_tokens_details"]["cached_tokens"],
                             "back_prompt_tokens": back_usage["input_tokens"]})
    write_rows("model_switch", rows, provenance, out=args.out, append=args.append)
    print("| round | prompt tokens | cold TTFT s | unload s | load s | back TTFT s | back TTFT less load s | cached/prompt |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['round']} | {r['prompt_tokens']} | {r['cold_ttft_s']} | {r['unload_s']} | {r['load_s']} | "
              f"{r['back_ttft_s']} | {r['back_ttft_less_load_s']} | {r['back_cached_tokens']}/{r['back_prompt_tokens']} |")


if __name__ == "__main__":
    main()
