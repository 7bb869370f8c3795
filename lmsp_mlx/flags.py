"""`python -m lmsp_mlx.serve`'s flags: the parser, its checks, and the `Settings` they make.

`parse(argv)` is the one place a command line becomes settings (lmsp_mlx/settings.py): each
value is read and checked here, once, and a bad one is a single line, `lmsp-mlx: error:
...`, with exit status 2. Nothing heavier than the standard library and platformdirs is
imported, so `--help` and a wrong flag answer at once.

`python -m lmsp_mlx.flags > docs/flags.md` writes the flag reference from this parser;
tests/test_docs.py fails when the committed page differs from what it writes now.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from platformdirs import user_cache_dir, user_data_dir

from .cli import Parser
from .settings import MiB, CacheSettings, EngineSettings, ServerSettings, Settings, SpeculateMode, StoreSettings

PROG = "python -m lmsp_mlx.serve"


def parser() -> Parser:
    p = Parser(prog=PROG, description="Serve an MLX model over LMSP 1.0.")
    _server_flags(p)
    _model_flags(p.add_argument_group("models"))
    _engine_flags(p.add_argument_group("batching and limits"))
    _store_flags(p.add_argument_group("stored responses and tasks"))
    _cache_flags(p.add_argument_group("KV cache"))
    return p


def parse(argv: list[str] | None = None) -> Settings:
    """The settings `argv` asks for, checked; a bad flag exits with its one-line error."""
    p = parser()
    args = p.parse_args(argv)
    if why := problem(args):
        p.error(why)
    return Settings(server=_server(args), engine=_engine(args), cache=_cache(args), store=_store(args))


# -- the flags, by group ---------------------------------------------------------------------


def _server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("LMSP_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (or $LMSP_API_KEY); this key has every scope")
    p.add_argument("--tokens", type=Path, help='tokens file: JSON {"<token>": ["responses:write", ...], ...}')
    p.add_argument("--max-body-mb", type=float, default=16.0, help="largest request body in MiB (default 16)")
    p.add_argument("--sse-keepalive", type=float, default=15.0,
                   help="seconds without an event before a stream sends a comment line that keeps it open (default 15)")
    p.add_argument("--cors-origin", action="append", type=_origin, default=[], metavar="ORIGIN",
                   help="a web page origin (https://ui.example:8443, or * for any) that may call this server from "
                        "a browser, besides loopback pages; repeatable")
    p.add_argument("--keep-billing-header", action="store_true",
                   help="render Claude Code's per-request 'x-anthropic-billing-header:' system line into the prompt, "
                        "as other servers do (it defeats KV reuse: for measuring that)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="default info: one line per request")


def _model_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--model", action="append", help="repeatable; the first is the default and loads at start, the "
                   "others on demand. An mlx-lm model directory, a .gguf file (converted into the store once), a name "
                   "in the model store, or a Hugging Face repo id (org/name[@revision]; its cache first, then a "
                   "download) (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--model-id", help="the id clients use for the first --model (default: the directory name)")
    p.add_argument("--model-alias", action="append", type=_alias, default=[], metavar="PATTERN=MODEL",
                   help="repeatable: requests for a model whose name matches the glob PATTERN get MODEL, e.g. "
                        "'claude-*=Qwen3-4B-4bit' for the names Claude Code sends (the first match wins)")
    p.add_argument("--chat-template", type=_template_file, metavar="FILE",
                   help="a Jinja chat template that replaces the model's own")
    p.add_argument("--chat-template-args", type=_template_args, default={}, metavar="JSON",
                   help='settings every rendering of the chat template gets, e.g. \'{"enable_thinking": false}\' '
                        "(a request's chat_template_kwargs win over them)")
    p.add_argument("--adapter-path", type=Path, metavar="DIR",
                   help="mlx-lm LoRA adapters (adapter_config.json, adapters.safetensors) for the model, fused "
                        "into its weights at load; KV checkpoints are kept apart from the base model's")
    p.add_argument("--models-dir", type=Path, help="the model store (default: models/ of the checkout, or $LMSP_MODELS_DIR)")
    p.add_argument("--memory-budget-mb", type=float, metavar="MB",
                   help="memory the loaded models may hold: their weights, the KV of their running sequences "
                        "(each grown to its output limit) and their resident KV sessions; a sequence waits until "
                        "its KV fits, a request whose KV never could is a 507 (default: the available memory less "
                        "10%%, at least 1 GiB)")
    p.add_argument("--memory-budget-scope", choices=("process", "models"), default="process",
                   help="process: the process's memory outside MLX's (requests, the store, Python objects), grown "
                        "past what it held once the first models loaded, takes room from the budget too (read on "
                        "Linux's CPU device); models: the budget counts what the models hold only, for a process "
                        "shared with other work (default process)")
    p.add_argument("--max-loaded-models", type=int, default=1,
                   help="models loaded at once; a request for another evicts the least recently used idle one, "
                        "its KV sessions checkpointed first (default 1)")
    p.add_argument("--keep-alive", type=_keep_alive, default=300.0, metavar="DURATION",
                   help="unload a model no request used for this long: seconds, or with s/m/h/d; -1: never "
                        "(default 5m)")
    p.add_argument("--pin", action="store_true",
                   help="keep the --model models loaded for the life of the server (loaded at start; never evicted "
                        "or unloaded for idleness)")


def _engine_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--ctx", type=int, help="context size in tokens (default: the model's trained context)")
    p.add_argument("--max-batch", type=int,
                   help="sequences decoded together in one batched step; more wait in the queue (default 8 on CPU, "
                        "32 on Metal and CUDA)")
    p.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait for a place in the batch before 429 (default 16)")
    p.add_argument("--max-output-tokens", type=int,
                   help="output limit of a request that sets none (default: the rest of the context)")
    p.add_argument("--prefill-chunk", type=int,
                   help="prefill chunk in tokens; cancellation is checked between chunks (default 256 on CPU, 2048 on GPU)")
    p.add_argument("--speculate", choices=("off", "ngram", "draft"),
                   help="speculative decoding: each sequence drafts its next tokens and one step verifies them; the "
                        "tokens are those decoding without it gives. ngram drafts from the sequence's own prompt and "
                        "reply (prompt lookup), draft with --draft-model (default ngram, or draft with --draft-model)")
    p.add_argument("--draft-model", metavar="ID",
                   help="a smaller model with the first --model's tokenizer that drafts for it (--speculate draft); "
                        "anything --model takes")
    p.add_argument("--pipeline", action="store_true",
                   help="under mlx.launch with several ranks: split the model's layers over them (pipeline "
                        "parallel: it buys memory, not speed) instead of each layer's heads (tensor parallel, the "
                        "default)")
    p.add_argument("--rank-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="under mlx.launch: a step (or an idle tick) that takes the ranks longer than this means one "
                        "stopped answering; its requests fail and the server exits with status 3 (default 60)")
    p.add_argument("--num-draft-tokens", type=int, default=4,
                   help="the most tokens a sequence drafts per step; the number in use adapts below it (default 4)")


def _store_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--store", type=Path, help="the SQLite store file (default: lmsp-mlx/store.sqlite3 under the user's data dir)")
    p.add_argument("--store-retention", type=_duration, default=30 * 86400.0,
                   help="how long stored responses and tasks are kept: seconds, or with s/m/h/d (default 30d)")
    p.add_argument("--state-key-file", type=Path,
                   help="the key that seals reasoning and compaction state handed to clients; created (0600) when "
                        "missing (default: lmsp-mlx/state.key under the user's data dir)")
    p.add_argument("--event-retention", type=_duration, default=3600.0,
                   help="how long a task's events stay replayable after it ended (default 1h)")


def _cache_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--kv-memory-mb", type=float, default=2048, help="resident KV sessions, in MiB (default 2048)")
    p.add_argument("--kv-disk-dir", type=Path, help="where KV checkpoints go (default: under the user's cache dir)")
    p.add_argument("--no-kv-disk", action="store_true", help="keep KV state in memory only")
    p.add_argument("--kv-disk-space-mb", type=float, default=4096, help="disk budget for checkpoints, in MiB (default 4096)")
    p.add_argument("--kv-checkpoint-min-tokens", type=int, default=512,
                   help="checkpoint after prefilling at least this many new tokens (default 512)")
    p.add_argument("--kv-checkpoint-every", type=int, default=2048,
                   help="checkpoint again once a session grew by this many tokens (default 2048)")
    p.add_argument("--kv-bits", type=int, choices=(4, 8),
                   help="keep the KV cache quantized to this many bits (mlx-lm's QuantizedKVCache; default: "
                        "the model's float dtype)")
    p.add_argument("--kv-group-size", type=int, choices=(32, 64, 128),
                   help="quantization group of --kv-bits (default 64)")


# -- checks across flags ---------------------------------------------------------------------

_POSITIVE = ("rank_timeout", "ctx", "max_batch", "max_queue", "max_output_tokens", "prefill_chunk", "num_draft_tokens", "max_body_mb",
             "sse_keepalive", "memory_budget_mb", "kv_memory_mb", "kv_disk_space_mb", "kv_checkpoint_min_tokens", "kv_checkpoint_every")
_FINITE = ("rank_timeout", "sse_keepalive", "max_body_mb", "memory_budget_mb", "kv_memory_mb", "kv_disk_space_mb")


def problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the parsed flags taken together, as the error's one line; None: nothing."""
    for name in _POSITIVE:
        if (value := getattr(args, name)) is not None and value <= 0:
            return f"{_flag(name)} must be positive"
    for name in _FINITE:
        if (value := getattr(args, name)) is not None and not math.isfinite(value):
            return f"{_flag(name)} must be a finite number"
    if args.max_loaded_models < 1:
        return "--max-loaded-models must be at least 1"
    if args.pin and len(args.model or [None]) > args.max_loaded_models:
        return f"--pin keeps {len(args.model)} models loaded but --max-loaded-models is {args.max_loaded_models}"
    if not 1 <= args.port <= 65535:
        return "--port must be between 1 and 65535"
    if args.speculate == "draft" and args.draft_model is None:
        return "--speculate draft needs --draft-model"
    if args.draft_model is not None and args.speculate not in (None, "draft", "off"):
        return f"--draft-model drafts under --speculate draft, not --speculate {args.speculate}"
    if args.kv_group_size is not None and args.kv_bits is None:
        return "--kv-group-size applies to a quantized KV cache: give --kv-bits too"
    return None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# -- the settings the flags make -------------------------------------------------------------


def _server(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(host=args.host, port=args.port, api_key=args.api_key, tokens_file=args.tokens,
                          max_body_bytes=int(args.max_body_mb * MiB), sse_keepalive=args.sse_keepalive,
                          cors_origins=tuple(args.cors_origin), keep_billing_header=args.keep_billing_header,
                          log_level=args.log_level)


def _engine(args: argparse.Namespace) -> EngineSettings:
    return EngineSettings(
        models=tuple(args.model or ()), model_id=args.model_id, adapter_path=args.adapter_path,
        chat_template=args.chat_template, chat_template_args=args.chat_template_args,
        model_aliases=tuple(args.model_alias), models_dir=args.models_dir,
        memory_budget_bytes=None if args.memory_budget_mb is None else int(args.memory_budget_mb * MiB),
        memory_budget_scope=args.memory_budget_scope,
        max_loaded_models=args.max_loaded_models, keep_alive=args.keep_alive, pin=args.pin, ctx=args.ctx,
        max_batch=args.max_batch, max_queue=args.max_queue, max_output_tokens=args.max_output_tokens,
        prefill_chunk=args.prefill_chunk, num_draft_tokens=args.num_draft_tokens, pipeline=args.pipeline,
        rank_timeout=args.rank_timeout,
        speculate=_speculate(args), draft_model=args.draft_model if _speculate(args) == "draft" else None)


def _speculate(args: argparse.Namespace) -> SpeculateMode:
    """--speculate as given; unset, draft where a --draft-model is named, else ngram (an
    explicit off loads no draft model). Prompt lookup is the default because where nothing
    it drafts is accepted it costs at most about 3% (its pause), and where replies quote
    their context it decodes up to 2x as fast (docs/speculative.md, measured)."""
    return args.speculate or ("draft" if args.draft_model else "ngram")


def _cache(args: argparse.Namespace) -> CacheSettings:
    disk = None if args.no_kv_disk else (args.kv_disk_dir or Path(user_cache_dir("lmsp-mlx")) / "kv")
    return CacheSettings(memory_bytes=int(args.kv_memory_mb * MiB), checkpoint_min_tokens=args.kv_checkpoint_min_tokens,
                         checkpoint_every=args.kv_checkpoint_every, kv_bits=args.kv_bits,
                         kv_group_size=args.kv_group_size or 64, disk_dir=disk,
                         disk_bytes=int(args.kv_disk_space_mb * MiB))


def _store(args: argparse.Namespace) -> StoreSettings:
    data = Path(user_data_dir("lmsp-mlx"))
    return StoreSettings(path=args.store or data / "store.sqlite3", retention=args.store_retention,
                         event_retention=args.event_retention, state_key_file=args.state_key_file or data / "state.key")


# -- value types: each turns one flag's text into its value, or says why not -------------------


def _duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    scale = units.get(text[-1:].lower(), None)
    try:
        value = float(text[:-1] if scale else text) * (scale or 1)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):  # nan would turn retention off without a word
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (like 3600, 90m, 12h or 30d)")
    if value <= 0:
        raise argparse.ArgumentTypeError("a duration must be positive")
    return value


def _keep_alive(text: str) -> float:
    if text.strip() in ("-1", "never", "inf"):
        return math.inf
    return _duration(text)


def _alias(text: str) -> tuple[str, str]:
    pattern, eq, target = text.partition("=")
    if not eq or not pattern.strip() or not target.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not PATTERN=MODEL (like 'claude-*=SmolLM2-135M-Instruct')")
    return pattern.strip(), target.strip()


def _template_args(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('must be a JSON object, like {"enable_thinking": false}')
    from .protocol.requests import template_settings

    try:
        return template_settings(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _template_file(text: str) -> str:
    try:
        return Path(text).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {getattr(exc, 'strerror', None) or exc}") from None


def _origin(text: str) -> str:
    if text.strip() == "*":
        return "*"
    if text.strip().lower() == "null":
        raise argparse.ArgumentTypeError("null is the origin any page can send from a sandboxed frame: serve the "
                                         "page from http://localhost, or give the server tokens (--api-key)")
    from .http.origins import normalized

    try:
        return normalized(text)  # as browsers send it, so it matches
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (or * for any page)") from None


# -- the flag reference ------------------------------------------------------------------------


def markdown(p: argparse.ArgumentParser | None = None) -> str:
    """docs/flags.md: every flag of `p` (the server's by default) by group, with its help."""
    p = p or parser()
    lines = ["# Flags", "",
             f"`{PROG} --help` prints these too. This page is generated from the parser in "
             "`lmsp_mlx/flags.py` by `python -m lmsp_mlx.flags > docs/flags.md`; "
             "`tests/test_docs.py` fails when it is stale. What each setting does is explained on "
             "the page of its topic (see the README's map).", ""]
    for group in p._action_groups:  # argparse keeps its groups there and offers no public accessor
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        title = "server" if group.title in ("options", "optional arguments") else group.title
        lines += [f"## {title}", "", "| flag | what it does |", "|---|---|"]
        lines += [f"| `{_usage(a)}` | {_cell(a.help or '')} |" for a in actions]
        lines.append("")
    return "\n".join(lines)


def _usage(action: argparse.Action) -> str:
    flag = action.option_strings[-1]
    if action.nargs == 0:
        return flag
    if action.choices:
        return f"{flag} {{{','.join(map(str, action.choices))}}}"
    return f"{flag} {action.metavar or action.dest.upper()}"


def _cell(text: str) -> str:
    return text.replace("%%", "%").replace("|", "\\|")


if __name__ == "__main__":
    sys.stdout.write(markdown())
