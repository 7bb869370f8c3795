"""`python -m lmsp_mlx.serve`: flags -> settings -> model -> engine -> Quart app -> Hypercorn.

`flags.parse` turns the command line into `Settings` (lmsp_mlx/settings.py); `build` turns
those into a `Service` (or a `StartError`, one line); `serve` runs Hypercorn on it until an
event is set. `main` joins them with the signal handling a
process needs; the tests run `build` and `serve` on a thread of their own process."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import os
import signal
import socket
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from . import flags
from .cli import ERROR
from .cpu_blas import accelerate
from .settings import CacheSettings, EngineSettings, Settings

# Where the CPU backend is set up: on Linux, MLX's float32 matmuls go to OpenBLAS only if
# the shim is loaded before anything imports mlx.core (cpu_blas/__init__.py).
accelerate()

# The rest of the package (MLX, mlx-lm, transformers, Quart: some 3 s) is imported by
# `build`, once the flags were read: --help and a wrong flag answer at once.
if TYPE_CHECKING:
    from .engine.distributed import Ranks
    from .engine.loader import LoadedModel
    from .engine.worker import Engine
    from .store import Database

log = logging.getLogger("lmsp_mlx")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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


def build(settings: Settings, ranks: Ranks | None = None) -> Service:
    """Settings -> tokens, store, state key, model, engine, app; raises StartError before
    serving. With `ranks` this is rank 0 of a model split over them (`join_ranks`)."""
    from .engine.loader import backend_name
    from .service.auth import Tokens, TokensError
    from .service.lifecycle import open_state
    from .service.sealing import StateKeyError, load_state_key
    from .store import Database, StoreError

    server = settings.server
    try:
        tokens = Tokens.load(server.api_key, server.tokens_file)
    except TokensError as exc:
        raise StartError(str(exc)) from None
    if not tokens.required and not _is_loopback(server.host):
        raise StartError(f"refusing to bind {server.host} without --api-key or --tokens: only loopback is open")
    if why := _bindable(server.host, server.port):
        raise StartError(f"cannot bind {_address(server.host, server.port)}: {why}")
    settings = replace(settings, engine=settings.engine.for_backend(backend_name()))
    try:
        db = Database(settings.store.path)
        state_key = load_state_key(settings.store.state_key_file)
    except (StoreError, StateKeyError) as exc:
        raise StartError(str(exc)) from None
    try:
        engine, lm = _start_engine(settings.engine, settings.cache, ranks)
    except StartError:
        db.close()
        raise
    log.info("model %s ready: context %d, %s on %s", lm.id, lm.context_length, lm.quantization, lm.backend)
    if lm.backend == "cpu":
        from .cpu_blas import status

        log.info("MLX CPU float32 matmuls: %s", status())
    log.info("store: %s", db.path)
    from .http.app import create_app  # after the model: a start error costs no Quart import

    state = open_state(engine, settings, tokens, db, state_key)
    return Service(create_app(state), engine, db, server.host, server.port)


def join_ranks(settings: Settings) -> tuple[Settings, Ranks | None]:
    """Where `mlx.launch` started this process: the ranks it is one of, and the settings a
    model split over them runs with (one --model, kept loaded, nothing loaded on demand,
    each rank's KV checkpoints in a folder of its own); else (settings, None). Raises StartError."""
    from .engine.distributed import DistributedError, join, launched

    if not launched():
        return settings, None
    engine = settings.engine
    if len(engine.models) > 1:
        raise StartError("a model split over ranks is served alone: give one --model")
    if engine.draft_model is not None:
        raise StartError("--draft-model is not served across ranks")
    try:
        ranks = join("pipeline" if engine.pipeline else "tensor")
    except DistributedError as exc:
        raise StartError(str(exc)) from None
    if ranks is None:
        return settings, None
    log.info("rank %d of %d (%s parallel)%s", ranks.rank, ranks.size, ranks.parallel,
             "" if ranks.rank else ": serving HTTP")
    cache = settings.cache
    if cache.disk_dir is not None:  # each rank writes its shard of every checkpoint into a folder of its own
        cache = replace(cache, disk_dir=cache.disk_dir / f"rank-{ranks.rank}-of-{ranks.size}")
        log.info("rank %d: KV checkpoints (this rank's shards) in %s", ranks.rank, cache.disk_dir)
    return replace(settings, engine=replace(engine, pin=True, keep_alive=math.inf), cache=cache), ranks


def follow(settings: Settings, ranks: Ranks) -> int:
    """A rank other than 0: load its part of the model and step with rank 0's worker until
    it stops; 3 where the ranks lost each other."""
    from .engine.loader import backend_name

    engine, _ = _start_engine(settings.engine.for_backend(backend_name()), settings.cache, ranks)
    log.info("rank %d: following rank 0's steps", ranks.rank)
    engine.wait()
    return 3 if engine.lost else 0


def _start_engine(settings: EngineSettings, cache: CacheSettings,
                  ranks: Ranks | None = None) -> tuple[Engine, LoadedModel]:
    from .engine import hub
    from .engine.catalog import Catalog
    from .engine.lockstep import Lockstep
    from .engine.loader import LoadOptions, ModelLoadError, check_model_dir
    from .engine.model_store import DEFAULT_MODEL, ModelStoreError, default_models_dir, ensure_packaged_model
    from .engine.slot import ModelSpec
    from .engine.worker import Engine

    store = settings.models_dir or default_models_dir()
    budget = settings.memory_budget_bytes
    shared = LoadOptions(template_args=settings.chat_template_args, memory_budget=budget)
    try:
        specs = []
        for i, spec in enumerate(settings.models or (None,)):
            if spec is None:
                path, named = ensure_packaged_model(DEFAULT_MODEL, store), None
            else:
                path, named = _model_path(spec, store)
            check_model_dir(path)  # every named model is checked now, not at its first request
            first = i == 0
            options = LoadOptions(settings.chat_template if first else None, settings.chat_template_args,
                                  settings.adapter_path if first else None, budget, ranks if first else None)
            model_id = (settings.model_id if first else None) or named or path.name
            if any(s.id == model_id for s in specs):
                raise StartError(f"two --model flags name the id {model_id!r}")
            draft = None
            if first and settings.draft_model is not None:
                draft, _ = _model_path(settings.draft_model, store)
                check_model_dir(draft)
            specs.append(ModelSpec(model_id, path, options, pinned=settings.pin, draft=draft))
        catalog = Catalog(specs, store, shared, aliases=settings.model_aliases, named_only=ranks is not None)
        for pattern, target in settings.model_aliases:
            if catalog.find(target) is None:
                raise StartError(f"--model-alias {pattern}={target}: no model {target!r} is served here "
                                 "(a --model id, or a name `python -m lmsp_mlx.models list` shows)")
        engine = Engine(catalog, settings, cache, Lockstep(ranks) if ranks is not None else None)
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
        # worker finishes its step (and checkpoints) while Hypercorn closes. Across ranks
        # the worker is given until --rank-timeout: mlx.launch stops every rank when one
        # dies, and the running requests should end as the worker ends them (failed, the
        # ranks lost), not as a shutdown.
        for _ in range(int(engine.settle_seconds / 0.05)):
            if not engine.busy or engine.lost:
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

    def on_lost() -> None:  # the model's ranks lost each other: stop, then exit 3
        try:
            loop.call_soon_threadsafe(stop.set)
        except RuntimeError:  # the loop has closed: serving already stopped
            pass

    service.engine.on_lost = on_lost
    await serve(service, stop)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["models"]:  # `lmsp-mlx models list|pull|rm`: the console script's other command
        from . import models

        return models.main(argv[1:])
    settings = flags.parse(argv)
    logging.basicConfig(level=settings.server.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    try:
        settings, ranks = join_ranks(settings)
        if ranks is not None and ranks.rank > 0:
            return follow(settings, ranks)
        service = build(settings, ranks)
    except StartError as exc:
        print(f"{ERROR} {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve_until_signalled(service))
    except OSError as exc:  # port in use, address not available
        print(f"{ERROR} cannot bind {_address(service.host, service.port)}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    finally:
        service.close()
    if service.engine.lost:
        print(f"{ERROR} lost the other ranks: {service.engine.lost}", file=sys.stderr)
        return 3
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
