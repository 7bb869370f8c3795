"""`python -m lmsp_mlx.serve`: flags -> model -> engine -> Quart app -> Hypercorn.

`build` turns parsed flags into a `Service` (or a `StartError`, one line); `serve` runs
Hypercorn on it until an event is set. `main` joins them with the signal handling a
process needs; the tests run `build` and `serve` on a thread of their own process."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import math
import os
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from platformdirs import user_data_dir

from .cli import ERROR, Parser
from .cpu_blas import accelerate

# Where the CPU backend is set up: on Linux, MLX's float32 matmuls go to OpenBLAS only if
# the shim is loaded before anything imports mlx.core (cpu_blas/__init__.py).
accelerate()

# The rest of the package (MLX, mlx-lm, transformers, Quart: some 3 s) is imported by
# `build`, once the flags were read: --help and a wrong flag answer at once.
if TYPE_CHECKING:
    from .engine.loader import LoadedModel
    from .engine.slot import CacheSettings
    from .engine.worker import Engine
    from .store import Database

log = logging.getLogger("lmsp_mlx")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog="python -m lmsp_mlx.serve", description="Serve an MLX model over LMSP 1.0.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument("--model", action="append", help="repeatable; the first is the default and loads at start, the "
                                   "others on demand. An mlx-lm model directory, a .gguf file (converted into the store once), a name "
                                   "in the model store, or a Hugging Face repo id "
                                   "(org/name[@revision]; its cache first, then a download) (default: the embedded "
                                   "SmolLM2-135M-Instruct)")
    p.add_argument("--chat-template", type=_template_file, metavar="FILE",
                   help="a Jinja chat template that replaces the model's own")
    p.add_argument("--chat-template-args", type=_template_args, default={}, metavar="JSON",
                   help='settings every rendering of the chat template gets, e.g. \'{"enable_thinking": false}\' '
                        "(a request's chat_template_kwargs win over them)")
    p.add_argument("--adapter-path", type=Path, metavar="DIR",
                   help="mlx-lm LoRA adapters (adapter_config.json, adapters.safetensors) for the model, fused "
                        "into its weights at load; KV checkpoints are kept apart from the base model's")
    p.add_argument("--memory-budget-mb", type=float, metavar="MB",
                   help="memory a model's weights may take once loaded; a bigger one is refused before its load "
                        "(default: the available memory less 10%%, at least 1 GiB)")
    p.add_argument("--model-id", help="the id clients use for the first --model (default: the directory name)")
    p.add_argument("--model-alias", action="append", type=_alias, default=[], metavar="PATTERN=MODEL",
                   help="repeatable: requests for a model whose name matches the glob PATTERN get MODEL, e.g. "
                        "'claude-*=Qwen3-4B-4bit' for the names Claude Code sends (the first match wins)")
    p.add_argument("--keep-billing-header", action="store_true",
                   help="render Claude Code's per-request 'x-anthropic-billing-header:' system line into the prompt, "
                        "as other servers do (it defeats KV reuse: for measuring that)")
    p.add_argument("--max-loaded-models", type=int, default=1,
                   help="models loaded at once; a request for another evicts the least recently used idle one, "
                        "its KV sessions checkpointed first (default 1)")
    p.add_argument("--keep-alive", type=_keep_alive, default=300.0, metavar="DURATION",
                   help="unload a model no request used for this long: seconds, or with s/m/h/d; -1: never "
                        "(default 5m)")
    p.add_argument("--pin", action="store_true",
                   help="keep the --model models loaded for the life of the server (loaded at start; never evicted "
                        "or unloaded for idleness)")
    p.add_argument("--models-dir", type=Path, help="the model store (default: models/ of the checkout, or $LMSP_MODELS_DIR)")
    p.add_argument("--api-key", default=os.environ.get("LMSP_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (or $LMSP_API_KEY); this key has every scope")
    p.add_argument("--tokens", type=Path, help='tokens file: JSON {"<token>": ["responses:write", ...], ...}')
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
    p.add_argument("--max-body-mb", type=float, default=16.0, help="largest request body in MiB (default 16)")
    p.add_argument("--sse-keepalive", type=float, default=15.0,
                   help="seconds without an event before a stream sends a comment line that keeps it open (default 15)")
    p.add_argument("--cors-origin", action="append", type=_origin, default=[], metavar="ORIGIN",
                   help="a web page origin (https://ui.example:8443, or * for any) that may call this server from "
                        "a browser, besides loopback pages; repeatable")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="default info: one line per request")
    st = p.add_argument_group("stored responses and tasks")
    st.add_argument("--store", type=Path, help="the SQLite store file (default: lmsp-mlx/store.sqlite3 under the user's data dir)")
    st.add_argument("--store-retention", type=_duration, default=30 * 86400.0,
                    help="how long stored responses and tasks are kept: seconds, or with s/m/h/d (default 30d)")
    st.add_argument("--state-key-file", type=Path,
                    help="the key that seals reasoning and compaction state handed to clients; created (0600) when "
                         "missing (default: lmsp-mlx/state.key under the user's data dir)")
    st.add_argument("--event-retention", type=_duration, default=3600.0,
                    help="how long a task's events stay replayable after it ended (default 1h)")
    kv = p.add_argument_group("KV cache")
    kv.add_argument("--kv-memory-mb", type=float, default=2048, help="resident KV sessions, in MiB (default 2048)")
    kv.add_argument("--kv-disk-dir", type=Path, help="where KV checkpoints go (default: under the user's cache dir)")
    kv.add_argument("--no-kv-disk", action="store_true", help="keep KV state in memory only")
    kv.add_argument("--kv-disk-space-mb", type=float, default=4096, help="disk budget for checkpoints, in MiB (default 4096)")
    kv.add_argument("--kv-checkpoint-min-tokens", type=int, default=512,
                    help="checkpoint after prefilling at least this many new tokens (default 512)")
    kv.add_argument("--kv-checkpoint-every", type=int, default=2048,
                    help="checkpoint again once a session grew by this many tokens (default 2048)")
    kv.add_argument("--kv-bits", type=int, choices=(4, 8),
                    help="keep the KV cache quantized to this many bits (mlx-lm's QuantizedKVCache; default: "
                         "the model's float dtype)")
    kv.add_argument("--kv-group-size", type=int, choices=(32, 64, 128),
                    help="quantization group of --kv-bits (default 64)")
    args = p.parse_args(argv)
    for name in ("ctx", "max_batch", "max_queue", "max_output_tokens", "prefill_chunk", "max_body_mb", "sse_keepalive", "memory_budget_mb", "kv_memory_mb", "kv_disk_space_mb",
                 "kv_checkpoint_min_tokens", "kv_checkpoint_every"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.max_loaded_models < 1:
        p.error("--max-loaded-models must be at least 1")
    if args.pin and len(args.model or [None]) > args.max_loaded_models:
        p.error(f"--pin keeps {len(args.model)} models loaded but --max-loaded-models is {args.max_loaded_models}")
    if not 1 <= args.port <= 65535:
        p.error("--port must be between 1 and 65535")
    if args.kv_group_size is not None and args.kv_bits is None:
        p.error("--kv-group-size applies to a quantized KV cache: give --kv-bits too")
    args.kv_group_size = args.kv_group_size or 64
    for name in ("sse_keepalive", "max_body_mb", "memory_budget_mb", "kv_memory_mb", "kv_disk_space_mb"):
        if getattr(args, name) is not None and not math.isfinite(getattr(args, name)):
            p.error(f"--{name.replace('_', '-')} must be a finite number")
    return args


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


def _mib(value: float | None) -> int | None:
    return None if value is None else int(value * 2**20)


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


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _address(host: str, port: int) -> str:
    return f"[{host.strip('[]')}]:{port}" if ":" in host else f"{host}:{port}"


def _bindable(host: str, port: int) -> str | None:
    """Why host:port cannot be bound, checked before the model loads (minutes for a big one)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Hypercorn binds
            s.bind(address)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


class StartError(Exception):
    """Why the server cannot start, as the one line `main` prints (exit status 2)."""


@dataclass
class Service:
    """What `build` made from the flags: the app and the two things it owns that need closing."""

    app: object  # the ASGI app of http.app.create_app
    engine: Engine
    db: Database
    host: str
    port: int

    def close(self) -> None:
        self.engine.stop()  # checkpoints resident KV sessions
        self.db.close()


def build(args: argparse.Namespace) -> Service:
    """Flags -> tokens, store, state key, model, engine, app; raises StartError before serving."""
    from .service.auth import Tokens, TokensError
    from .service.sealing import StateKeyError, load_state_key
    from .service.state import ServerSettings
    from .store import Database, StoreError

    try:
        tokens = Tokens.load(args.api_key, args.tokens)
    except TokensError as exc:
        raise StartError(str(exc)) from None
    if not tokens.required and not _is_loopback(args.host):
        raise StartError(f"refusing to bind {args.host} without --api-key or --tokens: only loopback is open")
    if why := _bindable(args.host, args.port):
        raise StartError(f"cannot bind {_address(args.host, args.port)}: {why}")
    try:
        db = Database(args.store or Path(user_data_dir("lmsp-mlx")) / "store.sqlite3")
        state_key = load_state_key(args.state_key_file or Path(user_data_dir("lmsp-mlx")) / "state.key")
    except (StoreError, StateKeyError) as exc:
        raise StartError(str(exc)) from None
    try:
        engine, lm = _start_engine(args)
    except StartError:
        db.close()
        raise
    log.info("model %s ready: context %d, %s on %s", lm.id, lm.context_length, lm.quantization, lm.backend)
    if lm.backend == "cpu":
        from .cpu_blas import status

        log.info("MLX CPU float32 matmuls: %s", status())
    prefill = args.prefill_chunk or (256 if lm.backend == "cpu" else 2048)
    settings = ServerSettings(prefill_step=prefill, max_body_bytes=int(args.max_body_mb * 1024 * 1024),
                              store_retention=args.store_retention, event_retention=args.event_retention,
                              sse_keepalive=args.sse_keepalive, cors_origins=tuple(args.cors_origin),
                              keep_billing_header=args.keep_billing_header)
    log.info("store: %s", db.path)
    from .http.app import create_app  # after the model: a start error costs no Quart import

    return Service(create_app(engine, settings, tokens, db, state_key), engine, db, args.host, args.port)


def _start_engine(args: argparse.Namespace) -> tuple[Engine, LoadedModel]:
    from .engine import hub
    from .engine.catalog import Catalog
    from .engine.footprint import budget_bytes
    from .engine.loader import LoadOptions, ModelLoadError, backend_name, check_model_dir
    from .engine.model_store import DEFAULT_MODEL, ModelStoreError, default_models_dir, ensure_packaged_model
    from .engine.slot import ModelSpec
    from .engine.worker import Engine, ModelLimits

    store = args.models_dir or default_models_dir()
    budget = _mib(args.memory_budget_mb)
    shared = LoadOptions(template_args=args.chat_template_args, memory_budget=budget)
    try:
        specs = []
        for i, spec in enumerate(args.model or [None]):
            if spec is None:
                path, named = ensure_packaged_model(DEFAULT_MODEL, store), None
            else:
                path, named = _model_path(spec, store)
            check_model_dir(path)  # every named model is checked now, not at its first request
            first = i == 0
            options = LoadOptions(args.chat_template if first else None, args.chat_template_args,
                                  args.adapter_path if first else None, budget)
            model_id = (args.model_id if first else None) or named or path.name
            if any(s.id == model_id for s in specs):
                raise StartError(f"two --model flags name the id {model_id!r}")
            specs.append(ModelSpec(model_id, path, options, pinned=args.pin))
        limit, source = budget_bytes(budget)
        catalog = Catalog(specs, store, shared, aliases=tuple(args.model_alias))
        for pattern, target in args.model_alias:
            if catalog.find(target) is None:
                raise StartError(f"--model-alias {pattern}={target}: no model {target!r} is served here "
                                 "(a --model id, or a name `python -m lmsp_mlx.models list` shows)")
        engine = Engine(catalog, ctx=args.ctx, max_queue=args.max_queue,
                        cache=_cache_settings(args), max_batch=args.max_batch or (8 if backend_name() == "cpu" else 32),
                        max_output_tokens=args.max_output_tokens,
                        limits=ModelLimits(args.max_loaded_models, args.keep_alive, limit, source))
        lm = engine.start()
    except (ModelStoreError, ModelLoadError, hub.HubError) as exc:
        raise StartError(str(exc)) from None
    return engine, lm


def _model_path(spec: str, store: Path) -> tuple[Path, str | None]:
    """--model as a GGUF file (converted into the store once), a directory, a name in the
    model store, or a Hugging Face repo id (engine/hub.py), in that order; and the id clients use where it is not the directory's name."""
    from .engine import hub

    from .engine.model_store import import_gguf

    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return import_gguf(path, store), path.stem
    if path.exists():
        return path, None
    if (store / spec).exists():
        return store / spec, None
    if hub.looks_like_repo_id(spec):
        if why := hub.invalid(spec):
            raise StartError(f"model {spec!r} is not a path, nor a name in the model store {store}, nor a Hugging Face "
                             f"repo id: {why}")
        return hub.resolve(spec), spec.partition("@")[0]  # as the hub names it (and mlx_lm.server)
    raise StartError(f"model {spec!r} does not exist, neither as a path, in the model store {store}, nor as a "
                     "Hugging Face repo id (org/name)")


async def serve(service: Service, stop: asyncio.Event) -> None:
    """Hypercorn on the service's address until `stop` is set; then generations in progress end cancelled."""
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    config = Config()
    config.bind = [_address(service.host, service.port)]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")  # one handler: ours
    config.graceful_timeout = 5
    engine = service.engine

    async def shutdown() -> None:
        await stop.wait()
        log.info("shutting down: cancelling generations in progress")
        engine.cancel_all()
        # A decode step ends within this with the real usage; a long prefill chunk would
        # hold its stream past the grace period, so streams end as cancelled now and the
        # worker finishes its step (and checkpoints) while Hypercorn closes.
        for _ in range(20):
            if not engine.busy:
                break
            await asyncio.sleep(0.05)
        engine.abandon_all()

    log.info("serving on http://%s (LMSP at /lmsp/v1, OpenAI-style at /v1)", _address(service.host, service.port))
    await hypercorn_serve(service.app, config, shutdown_trigger=shutdown)


async def _serve_until_signalled(service: Service) -> None:
    stop = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():  # asked twice: do not wait for the worker's step or its checkpoints
            log.warning("second signal: exiting now (resident KV sessions are not checkpointed)")
            logging.shutdown()
            os._exit(130)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    await serve(service, stop)


def _cache_settings(args: argparse.Namespace) -> CacheSettings:
    from platformdirs import user_cache_dir

    from .cache.pool import Policy
    from .engine.slot import CacheSettings

    policy = Policy(
        memory_bytes=int(args.kv_memory_mb * 2**20),
        checkpoint_min_tokens=args.kv_checkpoint_min_tokens,
        checkpoint_every=args.kv_checkpoint_every,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
    )
    disk = None if args.no_kv_disk else (args.kv_disk_dir or Path(user_cache_dir("lmsp-mlx")) / "kv")
    return CacheSettings(policy=policy, disk_dir=disk, disk_bytes=int(args.kv_disk_space_mb * 2**20))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["models"]:  # `lmsp-mlx models list|pull|rm`: the console script's other command
        from . import models

        return models.main(argv[1:])
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=LOG_FORMAT,
        stream=sys.stderr,
    )
    try:
        service = build(args)
    except StartError as exc:
        print(f"{ERROR} {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve_until_signalled(service))
    except OSError as exc:  # port in use, address not available
        print(f"{ERROR} cannot bind {_address(args.host, args.port)}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    finally:
        service.close()
    return 0


if __name__ == "__main__":
    code = main()
    # MLX used from a non-main thread can abort in its C++ static destructors at exit
    # ("terminate called without an active exception", ml-explore/mlx#3126). The worker
    # has stopped and everything is flushed, so leave without running them.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
