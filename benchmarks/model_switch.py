"""Switching models on one server: unload + load of the default model, and a switched-back
session's time to first token from its checkpoint against its cold prefill.

    python benchmarks/model_switch.py [--prompt-words 600] [--rounds 3]

One `python -m lmsp_mlx.serve --model <default> --model <second> --max-loaded-models 1`:
each round sends a fresh long conversation to the default model (its cold prefill), then
one request to a second model (which evicts the default, its KV sessions checkpointed),
then the first conversation's next turn to the default model again (it is loaded again
and its session restored from the checkpoint). Times to first token are the client's
(streamed); load and unload times are the server's log lines. The second model is the
default's own directory under another name, so both loads cost the same.
Writes benchmarks/results/model_switch.csv and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ttft(url: str, model: str, messages: list[dict]) -> tuple[float, dict]:
    """Seconds to the first output delta, and the final usage."""
    began, first, usage = time.perf_counter(), None, {}
    body = {"model": model, "input": messages, "stream": True, "max_output_tokens": 8, "temperature": 0}
    with httpx.stream("POST", url + "/lmsp/v1/responses", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if first is None and event["type"].endswith(".delta"):
                first = time.perf_counter() - began
            if "usage" in event and event["usage"]:
                usage = event["usage"]
    return first if first is not None else time.perf_counter() - began, usage


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompt-words", type=int, default=600)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from lmsp_mlx.engine.model_store import DEFAULT_MODEL, default_models_dir, ensure_packaged_model

    default = ensure_packaged_model(DEFAULT_MODEL, default_models_dir())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        second = Path(tmp) / "second"
        shutil.copytree(default, second)
        port, log = free_port(), Path(tmp) / "server.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "lmsp_mlx.serve", "--port", str(port), "--model", str(default), "--model",
                 str(second), "--max-loaded-models", "1", "--keep-alive", "-1", "--kv-disk-dir", f"{tmp}/kv",
                 "--store", f"{tmp}/store.sqlite3", "--state-key-file", f"{tmp}/key", "--models-dir", f"{tmp}/models"],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):
                try:
                    if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
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
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "model_switch.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print("| round | prompt tokens | cold TTFT s | unload s | load s | back TTFT s | back TTFT less load s | cached/prompt |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['round']} | {r['prompt_tokens']} | {r['cold_ttft_s']} | {r['unload_s']} | {r['load_s']} | "
              f"{r['back_ttft_s']} | {r['back_ttft_less_load_s']} | {r['back_cached_tokens']}/{r['back_prompt_tokens']} |")


if __name__ == "__main__":
    main()
