"""One servable model and, while it is loaded, everything the worker keeps for it.

A `ModelSpec` is what the server can serve under an id (a directory and how to load it);
a `ModelSlot` is a spec loaded: its weights, its own KV session pool and checkpoint folder
(by fingerprint), its own remembered tool calls and its own batch. Nothing of one model's
slot is ever used for another's requests: a batch holds one model's sequences.

A slot is opened (`open_slot`) on whichever thread loads it, then used by the worker
thread only; `close_slot` (on the worker) checkpoints its resident KV sessions and lets
its arrays go.
"""

from __future__ import annotations

import asyncio
import enum
import gc
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx

from ..cache.calls import CallMemory
from ..cache.disk import CheckpointStore
from ..cache.pool import SessionPool
from ..settings import CacheSettings
from .batch import Batch, log_prefill_alone
from .distributed import Ranks, same_everywhere
from .footprint import KVGrowth, gb, kv_growth
from .loader import LoadedModel, LoadOptions, ModelLoadError, check_model_dir, load_model

log = logging.getLogger("lmsp_mlx.engine")


@dataclass(frozen=True)
class ModelSpec:
    id: str  # what clients send as `model`
    path: Path
    options: LoadOptions = LoadOptions()
    pinned: bool = False  # never unloaded while the server runs (--pin)
    draft: Path | None = None  # the model that drafts for it (--draft-model), loaded beside it


class SlotState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    RETIRING = "retiring"  # being unloaded: its KV sessions are checkpointed first


@dataclass(eq=False)
class ModelSlot:
    spec: ModelSpec
    state: SlotState = SlotState.LOADING
    lm: LoadedModel | None = None
    pool: SessionPool | None = None
    batch: Batch | None = None
    draft: LoadedModel | None = None  # spec.draft loaded: its tokenizer is the model's
    calls: CallMemory = field(default_factory=CallMemory)  # read by request handlers while they render (locked)
    size_bytes: int = 0  # its weights once loaded (engine/footprint.py), counted against the memory budget
    kv: KVGrowth | None = None  # what a sequence's KV takes by length (engine/admission.py); None: it holds none
    leases: int = 0  # runs that hold it (event loop); it is unloaded only at none
    last_used: float = 0.0  # time.monotonic() of its last lease's end: the least recent goes first
    loaded: asyncio.Future | None = None  # the load's outcome, for requests that wait for it
    idle: asyncio.TimerHandle | None = None  # --keep-alive's unload, while no run holds it

    @property
    def id(self) -> str:
        return self.spec.id


def footprint(spec: ModelSpec) -> int:
    """The spec's weights once loaded, before loading them (ModelLoadError for a broken directory)."""
    from .footprint import estimate_bytes
    from .loader import backend_name

    ranks = spec.options.ranks.size if spec.options.ranks is not None else 1
    weights = estimate_bytes(spec.path, check_model_dir(spec.path), backend_name(), ranks)
    if spec.draft is not None:
        weights += estimate_bytes(spec.draft, check_model_dir(spec.draft), backend_name())
    return weights


def open_slot(slot: ModelSlot, *, ctx: int | None, cache: CacheSettings, max_output_tokens: int | None,
              copy_room: Callable[[int], bool] | None = None) -> None:
    """Load the slot's model, its session pool and its batch (slow: any thread but the event
    loop's). `copy_room`: the memory budget's check for a checkpoint's host copy (SessionPool)."""
    spec = slot.spec
    lm = load_model(spec.path, model_id=spec.id, ctx=ctx, options=spec.options)
    lm.default_max_output_tokens = max_output_tokens
    if spec.draft is not None:
        slot.draft = _open_draft(lm, spec.draft)
    slot.pool = _make_pool(lm, cache, slot.calls, spec.options.ranks, copy_room)
    slot.batch = Batch(lm)
    log_prefill_alone(lm)
    if "text" in lm.capabilities:
        slot.kv = kv_growth(lm)
        log.info("kv for %s: %s a sequence, %s per 1,000 tokens (measured)", spec.id, gb(slot.kv.fixed),
                 gb(slot.kv.per_token * 1000))
    slot.lm = lm


def close_slot(slot: ModelSlot) -> None:
    """The worker's part of an unload: checkpoint the resident sessions, then let the arrays go."""
    if slot.pool is not None:
        try:
            slot.pool.close()
        except Exception:  # the model goes anyway; its sessions are lost, not the server
            log.exception("model %s: its KV sessions could not be checkpointed", slot.id)
    slot.lm = slot.pool = slot.batch = slot.draft = None
    gc.collect()
    mx.clear_cache()


def _open_draft(lm: LoadedModel, path: Path) -> LoadedModel:
    """The draft model of `lm`: loaded as any model, and refused unless its tokenizer is lm's
    (a draft token is an id, and it must mean the same text to both)."""
    from .speculate import same_tokenizer

    draft = load_model(path, model_id=f"{lm.id} (draft)")
    if (why := same_tokenizer(lm, draft)) is not None:
        raise ModelLoadError(f"--draft-model {path} cannot draft for {lm.id}: {why}")
    log.info("model %s: drafts with %s (%s, %s)", lm.id, path.name, draft.runner.describe(), draft.quantization)
    return draft


def _make_pool(lm: LoadedModel, cs: CacheSettings, calls: CallMemory, ranks: Ranks | None,
               copy_room: Callable[[int], bool] | None) -> SessionPool:
    fingerprint = lm.fingerprint
    if cs.kv_bits:  # checkpoints of quantized KV belong to their own folder
        lm.kv_cache = f"{cs.kv_bits}-bit, group {cs.kv_group_size}"
        fingerprint = hashlib.sha256(f"{fingerprint}:kv:{lm.kv_cache}".encode()).hexdigest()
    disk = None
    if cs.disk_dir is not None:
        try:
            vocab = lm.vocab_size or 2**31
            disk = CheckpointStore(cs.disk_dir, fingerprint, cs.disk_bytes, calls=calls, vocab_size=vocab)
        except OSError as exc:
            log.warning("kv disk %s unusable (%s): checkpoints are off", cs.disk_dir, exc)
    # Across ranks each writes its shard of a checkpoint in a folder of its own (serve.py),
    # and a restore needs every rank's.
    agree = None if ranks is None else (lambda tokens: same_everywhere(tokens, ranks))
    pool = SessionPool(lm.model, lm.tokenizer, cs, disk, agree, copy_room)
    if cs.kv_bits:  # a quantized cache the model cannot use is a start-up error, not a 500 later
        try:
            mx.eval(lm.runner.forward(mx.array([[0]]), pool.new_cache()))
        except ValueError as exc:
            raise ModelLoadError(f"--kv-bits {cs.kv_bits} with --kv-group-size {cs.kv_group_size} "
                                 f"does not fit {lm.id}: {exc}") from None
        except (AttributeError, TypeError) as exc:  # an attention that reads its cache as arrays (DeepSeek V3's MLA)
            raise ModelLoadError(f"--kv-bits does not fit {lm.id}: its attention ({type(lm.model).__module__}) "
                                 f"does not read a quantized KV cache ({type(exc).__name__}: {exc})") from None
    return pool
