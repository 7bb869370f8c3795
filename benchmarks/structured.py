"""What constrained decoding costs: decode tok/s under a JSON Schema against free text, one run.

    python -m benchmarks.structured [--model PATH] [--tokens 128] [--pairs 4] [--out DIR] [--append]

One server, the default model, greedy. Each pair runs the same prompt twice: once free,
once with `response_format` set to a moderately complex schema (20 properties: nested
objects, arrays, enums, numbers, patterns). The rate is the worker's own (`decode_tps=`
in the server log), from the first token to the last. Target: the constrained rate at least
0.85 of the free one (median of the pairs' ratios). Writes benchmarks/results/structured.csv
(with the run's provenance columns; `--append` adds to its history).
"""

from __future__ import annotations

import httpx

from benchmarks.common import Provenance
from benchmarks.paired import arguments, report, run_after, runs_so_far, server

PROMPT = "Invent a detailed customer record for a bicycle shop and write it out in full."

WORD = {"type": "string", "maxLength": 40}
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^C-[0-9]{6}$"},
        "first_name": WORD, "last_name": WORD, "email": WORD, "phone": WORD,
        "age": {"type": "integer", "minimum": 16, "maximum": 99},
        "member": {"type": "boolean"},
        "tier": {"enum": ["bronze", "silver", "gold"]},
        "address": {"type": "object", "properties": {"street": WORD, "city": WORD, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                     "country": WORD},
                    "required": ["street", "city", "zip", "country"], "additionalProperties": False},
        "bikes": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "brand": WORD, "model": WORD, "year": {"type": "integer", "minimum": 1990, "maximum": 2026},
            "kind": {"enum": ["road", "mountain", "city", "cargo"]}}, "required": ["brand", "model", "year", "kind"],
            "additionalProperties": False}},
        "favourite_color": {"enum": ["red", "blue", "green", "black", "white"]},
        "visits": {"type": "integer", "minimum": 0},
        "spent": {"type": "number", "minimum": 0, "multipleOf": 0.01},
        "newsletter": {"type": "boolean"},
        "notes": WORD,
        "tags": {"type": "array", "items": {"enum": ["racer", "commuter", "family", "tourer"]}, "maxItems": 4},
        "referrer": {"type": ["string", "null"], "maxLength": 40},
        "last_service": {"type": "string", "format": "date"},
        "preferred_contact": {"enum": ["email", "phone", "none"]},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["id", "first_name", "last_name", "email", "age", "member", "tier", "address", "bikes", "visits", "spent",
                 "newsletter", "tags", "last_service", "preferred_contact", "rating"],
    "additionalProperties": False,
}


def main() -> None:
    args = arguments(__doc__)
    provenance = Provenance.gather()
    rows = []
    with server(args.model, "structured-") as (url, model, log):
        free = {"model": model, "input": PROMPT, "temperature": 0, "max_output_tokens": args.tokens}
        constrained = {**free, "response_format": {"type": "json_schema", "json_schema": {"name": "customer", "schema": SCHEMA}}}
        with httpx.Client(base_url=url, timeout=900) as client:
            client.post("/lmsp/v1/responses", json=constrained)  # warm-up: the tokenizer's llguidance view is built once
            for pair in range(args.pairs):
                for kind, body in (("free", free), ("json_schema", constrained)):
                    n = runs_so_far(log)
                    r = client.post("/lmsp/v1/responses", json=body)
                    assert r.status_code == 200, r.text
                    tokens, rate = run_after(log, n)
                    rows.append({"pair": pair, "kind": kind, "output_tokens": tokens, "decode_tps": rate})
                    print(f"pair {pair} {kind:>11}: {rate:6.1f} tok/s over {tokens} tokens", flush=True)
    free_rate, json_rate, ratio = report("structured", rows, args, provenance, ("free", "json_schema"))
    print(f"\n| decode, up to {args.tokens} tokens | free text | json_schema (20 properties) | ratio (median of pairs) | target |")
    print("|---|---:|---:|---:|---:|")
    print(f"| {model} | {free_rate:.1f} tok/s | {json_rate:.1f} tok/s | {ratio:.3f} | ≥ 0.85 |")


if __name__ == "__main__":
    main()
