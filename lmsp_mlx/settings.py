"""The server's settings, typed: what the flags become, once, before anything starts.

`lmsp_mlx/flags.py` parses and validates the command line and builds one `Settings`;
`serve.py` hands each layer its own part and never a Namespace:

- `ServerSettings` to the HTTP adapters and the service (address, auth, bodies, streams);
- `EngineSettings` to the engine (which models, how many at once, batch and queue sizes);
- `CacheSettings` to the KV session pool and its checkpoints (lmsp_mlx/cache);
- `StoreSettings` to the SQLite store and its retention (lmsp_mlx/store, service/lifecycle.py).

Every value here has been checked (`flags.py`: positive sizes, finite numbers, a port in
range, a group size only with a bit width, ...), so the layers below trust them. Sizes are
bytes and durations seconds, whatever unit their flag takes. `None` means "chosen later
from what only the running machine knows": the backend (`EngineSettings.for_backend`) or
the memory available (engine/footprint.py).

This module imports nothing of the package, so that every layer may read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

LogLevel = Literal["debug", "info", "warning", "error"]
Backend = Literal["metal", "cuda", "cpu"]
SpeculateMode = Literal["off", "ngram", "draft"]  # --speculate (engine/speculate.py)
BudgetScope = Literal["process", "models"]  # --memory-budget-scope (engine/admission.py)
MiB = 2**20


@dataclass(frozen=True)
class ServerSettings:
    """What the HTTP adapters and the service read."""

    host: str = "127.0.0.1"  # anything but loopback needs tokens (serve.build refuses it otherwise)
    port: int = 8000
    api_key: str | None = None  # one token holding every scope
    tokens_file: Path | None = None  # more tokens, each with its scopes (service/auth.py)
    max_body_bytes: int = 16 * MiB  # larger request bodies get 413
    sse_keepalive: float = 15.0  # seconds of silence on an event stream before a comment line keeps it open
    cors_origins: tuple[str, ...] = ()  # web pages besides loopback ones that may call it (http/origins.py)
    # Render Claude Code's per-request billing line (protocol/messages.py) as the peers do,
    # which makes every prompt differ from its first line: for measuring what it costs.
    keep_billing_header: bool = False
    log_level: LogLevel = "info"


@dataclass(frozen=True)
class EngineSettings:
    """What the engine serves and how much of it at once."""

    models: tuple[str, ...] = ()  # --model as given: paths, .gguf files, store names, repo ids; () the embedded default
    model_id: str | None = None  # the id of the first model (default: its directory's name, a repo id itself)
    adapter_path: Path | None = None  # LoRA adapters fused into the first model at load
    chat_template: str | None = None  # the text of a Jinja template replacing the first model's own
    chat_template_args: dict = field(default_factory=dict)  # every rendering's settings (protocol/requests.py checked them)
    model_aliases: tuple[tuple[str, str], ...] = ()  # (glob pattern, model id): the first match wins
    models_dir: Path | None = None  # the model store (None: engine/model_store.py's default)
    memory_budget_bytes: int | None = None  # what loaded weights may take (None: the available memory less a margin)
    memory_budget_scope: BudgetScope = "process"  # process: the growth of memory outside MLX's counts too
    max_loaded_models: int = 1
    keep_alive: float = 300.0  # seconds an unused model stays loaded; math.inf: for ever
    pin: bool = False  # the --model models load at start and stay loaded
    ctx: int | None = None  # context size in tokens (None: the model's trained context)
    max_batch: int | None = None  # sequences decoded together (None: by backend, for_backend)
    max_queue: int = 16  # requests that may wait for a place in the batch before 429
    max_output_tokens: int | None = None  # the limit of a request that sets none (None: the rest of the context)
    prefill_chunk: int | None = None  # prompt tokens per prefill step (None: by backend, for_backend)
    speculate: SpeculateMode = "ngram"  # --speculate: how sequences draft tokens a step verifies (engine/speculate.py)
    num_draft_tokens: int = 4  # the most a sequence drafts per step; the number in use adapts below it
    draft_model: str | None = None  # --draft-model: what drafts for the first --model under --speculate draft
    rank_timeout: float = 60.0  # --rank-timeout: seconds without a step together before the ranks count as lost
    pipeline: bool = False  # --pipeline: under mlx.launch, split the layers over the ranks (else each layer's heads)

    def for_backend(self, backend: Backend) -> EngineSettings:
        """These settings with the sizes left to the backend filled in: a CPU step is slow,
        so its batch and prefill chunk are small enough for running streams to move."""
        cpu = backend == "cpu"
        return replace(self, max_batch=self.max_batch or (8 if cpu else 32),
                       prefill_chunk=self.prefill_chunk or (256 if cpu else 2048))


@dataclass(frozen=True)
class CacheSettings:
    """How KV sessions are kept: resident in memory, checkpointed to disk, quantized or not."""

    memory_bytes: int = 2048 * MiB  # resident sessions; the least recently used are evicted (to disk) beyond it
    checkpoint_min_tokens: int = 512  # checkpoint after prefilling at least this many new tokens
    checkpoint_every: int = 2048  # ... or once the context grew this much since the last one
    checkpoint_on_evict: bool = True
    checkpoint_on_shutdown: bool = True
    kv_bits: int | None = None  # quantized KV (QuantizedKVCache) for models whose layers all use KVCache
    kv_group_size: int = 64
    disk_dir: Path | None = None  # where checkpoints go, a folder per model fingerprint (None: none on disk)
    disk_bytes: int = 4096 * MiB  # the checkpoints' budget; the lowest-scoring files go first


@dataclass(frozen=True)
class StoreSettings:
    """The SQLite store of responses, tasks and idempotency keys, and the key that seals client state."""

    path: Path = Path("store.sqlite3")
    retention: float = 30 * 86400.0  # seconds a stored response or task is kept
    event_retention: float = 3600.0  # seconds a task's events stay replayable after it ended
    state_key_file: Path = Path("state.key")  # 32 bytes, created (0600) when missing (service/sealing.py)

    @property
    def sweep_period(self) -> float:
        """How often what is past retention is deleted: a tenth of the shorter retention, at most a minute."""
        return min(60.0, self.event_retention / 10, self.retention / 10)


@dataclass(frozen=True)
class Settings:
    server: ServerSettings = ServerSettings()
    engine: EngineSettings = EngineSettings()
    cache: CacheSettings = CacheSettings()
    store: StoreSettings = StoreSettings()
