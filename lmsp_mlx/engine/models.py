"""Which models are loaded: on-demand loads, LRU eviction, idle unloads, and fair turns.

`ModelSet` lives on the event loop: requests `acquire` a model's slot (loading it when it
is not loaded) and `release` it when their run has ended. Its invariants:

- at most `max_loaded` slots are loaded or loading, and their estimated weights stay within
  `budget` bytes; a model that alone exceeds the budget is refused (`NotEnoughMemory`);
- a slot is unloaded only while no run holds it (leases 0), and its KV sessions are
  checkpointed first (on the worker thread, which owns them: `retire`);
- the least recently used idle, unpinned slot is the one evicted for a load; a slot idle
  for `keep_alive` seconds is unloaded on its own;
- fairness: while a request waits for room another model holds, that model takes no new
  leases; once its runs end it is evicted, and the waiting model's turn comes. The requests
  that came while their model was not loaded lease it first once it is, and it is not
  evicted before they do. With work for two models and room for one, they alternate
  instead of one starving the other (or both evicting each other's loads);
- two requests for one unloaded model load it once: the second waits for the first's load.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Awaitable, Callable

from .footprint import gb
from .loader import ModelLoadError
from .slot import ModelSlot, ModelSpec, SlotState, footprint

log = logging.getLogger("lmsp_mlx.engine")


class ModelNotFound(LookupError):
    """No model of this id can be served here."""


class NotEnoughMemory(RuntimeError):
    """The model cannot fit the memory budget, even with every other model unloaded."""


class NoModelRoom(RuntimeError):
    """The pinned models take every place --max-loaded-models allows."""


class ModelSet:
    def __init__(self, find: Callable[[str], ModelSpec | None], load: Callable[[ModelSlot], Awaitable[None]],
                 retire: Callable[[ModelSlot], Awaitable[None]], *, max_loaded: int, keep_alive: float,
                 budget: int | None, budget_source: str) -> None:
        self._find = find  # the spec of an id: flags, model store, Hugging Face cache
        self._load = load  # open_slot off the event loop
        self._retire = retire  # close_slot on the worker
        self.max_loaded = max_loaded
        self.keep_alive = keep_alive  # seconds; math.inf: never
        self.budget, self._budget_source = budget, budget_source
        self.slots: dict[str, ModelSlot] = {}  # loaded or loading, by id
        self._wanting: list[str] = []  # models waiting for room, first come first
        self._change: asyncio.Future | None = None  # done at the next change (_changed); replaced after
        self._lock = asyncio.Lock()  # one load or unload decision at a time

    def adopt(self, slot: ModelSlot) -> None:
        """A slot the start loaded before the event loop ran."""
        self.slots[slot.id] = slot

    def begin(self) -> None:
        """On the serving loop, once: the models the start loaded idle from now on."""
        for slot in self.slots.values():
            if slot.leases == 0:
                self._idle_from_now(slot)

    def _idle_from_now(self, slot: ModelSlot) -> None:
        if not slot.spec.pinned and math.isfinite(self.keep_alive):
            loop = asyncio.get_running_loop()
            slot.idle = loop.call_later(self.keep_alive, lambda: loop.create_task(self._idle(slot)))

    def loaded(self, model_id: str) -> bool:
        slot = self.slots.get(model_id)
        return slot is not None and slot.state is SlotState.READY

    async def acquire(self, model_id: str) -> ModelSlot:
        """The model's slot, loaded, with a lease the caller must `release`."""
        held = self.slots.get(model_id)
        spec = held.spec if held is not None else await asyncio.to_thread(self._find, model_id)  # may list the disk
        if spec is None:
            raise ModelNotFound(model_id)
        # `waiting`: this request came while its model was not loaded, so it is in _wanting
        # until it leases: the load is for it, its slot is not evicted before it leases, and
        # it leases ahead of the other model's waiters (without that, two models' waiters
        # would evict each other's fresh loads forever). One that came while its model was
        # loaded but owed its turn waits without wanting anything.
        waiting = False
        try:
            while True:
                changed = self._changed()  # taken before looking: a change after the look still wakes it
                slot = self.slots.get(model_id)
                if slot is not None and slot.state is SlotState.READY and (waiting or not self._owes_turn(slot)):
                    slot.leases += 1
                    if slot.idle is not None:
                        slot.idle.cancel()
                        slot.idle = None
                    return slot
                if not waiting and (slot is None or slot.state is SlotState.LOADING):
                    waiting = True
                    self._wanting.append(model_id)
                if slot is not None and slot.state is SlotState.LOADING:
                    await asyncio.shield(slot.loaded)  # its load's error is this request's too
                    continue
                if slot is None and await self._make_room(spec):
                    continue
                await asyncio.shield(changed)  # a waiter that leaves must not cancel it for the others
        finally:
            if waiting:
                self._wanting.remove(model_id)

    def release(self, slot: ModelSlot) -> None:
        slot.leases -= 1
        slot.last_used = time.monotonic()
        if slot.leases == 0:
            self._idle_from_now(slot)
        self._notify()

    async def unload(self, model_id: str) -> bool:
        """Unload the model once its runs end (new requests for it wait and load it again
        afterwards). False if it was not loaded."""
        slot = self.slots.get(model_id)
        if slot is None:
            return False
        if slot.state is SlotState.LOADING:
            try:
                await asyncio.shield(slot.loaded)
            except Exception:
                return False
        while slot.leases:
            await asyncio.shield(self._changed())
        async with self._lock:
            if self.slots.get(model_id) is slot and slot.state is SlotState.READY:
                await self._unload(slot, "unloaded on request")
        return True

    # -- inside ----------------------------------------------------------------------------

    def _owes_turn(self, slot: ModelSlot) -> bool:
        """A request for another model waits for the room this one holds: no new leases."""
        return not slot.spec.pinned and any(w != slot.id for w in self._wanting)

    async def _make_room(self, spec: ModelSpec) -> bool:
        """Start loading `spec` if there is room, evicting idle models for it; False to wait."""
        async with self._lock:
            if spec.id in self.slots:
                return True
            need = footprint(spec)
            if self.budget is not None and need > self.budget:
                raise NotEnoughMemory(f"{spec.id} needs about {gb(need)} once loaded but {gb(self.budget)} may be "
                                      f"used ({self._budget_source})")
            pinned = [s for s in self.slots.values() if s.spec.pinned]
            if len(pinned) >= self.max_loaded:
                raise NoModelRoom(f"{spec.id} cannot be loaded: the pinned models ({', '.join(s.id for s in pinned)}) "
                                  f"take every place --max-loaded-models {self.max_loaded} allows")
            if self.budget is not None and sum(s.size_bytes for s in pinned) + need > self.budget:
                raise NotEnoughMemory(f"{spec.id} cannot be loaded beside the pinned models "
                                      f"({', '.join(s.id for s in pinned)}): {gb(self.budget)} of memory may be used "
                                      f"({self._budget_source})")
            while not self._fits(need):
                idle = [s for s in self.slots.values() if s.state is SlotState.READY and s.leases == 0
                        and not s.spec.pinned and s.id not in self._wanting]  # not before its waiters lease
                if not idle:
                    return False
                await self._unload(min(idle, key=lambda s: s.last_used), f"evicted for {spec.id}")
            slot = ModelSlot(spec, size_bytes=need, loaded=asyncio.get_running_loop().create_future())
            self.slots[spec.id] = slot
        asyncio.get_running_loop().create_task(self._open(slot), name=f"load {spec.id}")
        return True

    def _fits(self, need: int) -> bool:
        if len(self.slots) >= self.max_loaded:
            return False
        used = sum(s.size_bytes for s in self.slots.values())
        return self.budget is None or used + need <= self.budget

    async def _open(self, slot: ModelSlot) -> None:
        began = time.monotonic()
        log.info("model %s: loading on demand (%d of %d loaded)", slot.id, len(self.slots), self.max_loaded)
        try:
            await self._load(slot)
        except Exception as exc:
            if self.slots.get(slot.id) is slot:
                del self.slots[slot.id]
            if not isinstance(exc, ModelLoadError):
                log.exception("model %s: the load failed", slot.id)
                exc = ModelLoadError(f"cannot load {slot.id}: {type(exc).__name__}: {exc}")
            slot.loaded.set_exception(exc)
            slot.loaded.exception()  # retrieved: a load nobody waited for is not an asyncio warning
        else:
            slot.state = SlotState.READY
            slot.last_used = time.monotonic()
            log.info("model %s: loaded in %.1f s", slot.id, time.monotonic() - began)
            slot.loaded.set_result(None)
            if slot.leases == 0:
                self._idle_from_now(slot)
        self._notify()

    async def _idle(self, slot: ModelSlot) -> None:
        async with self._lock:
            if (self.slots.get(slot.id) is slot and slot.leases == 0 and slot.state is SlotState.READY
                    and slot.id not in self._wanting):
                await self._unload(slot, f"idle for {self.keep_alive:g} s (--keep-alive)")

    async def _unload(self, slot: ModelSlot, why: str) -> None:
        slot.state = SlotState.RETIRING
        if slot.idle is not None:
            slot.idle.cancel()
            slot.idle = None
        began = time.monotonic()
        await self._retire(slot)
        del self.slots[slot.id]
        log.info("model %s: unloaded, %s (KV sessions checkpointed; %.1f s)", slot.id, why, time.monotonic() - began)
        self._notify()

    def _changed(self) -> asyncio.Future:
        """A future that is done at the next change of any slot's state or leases."""
        if self._change is None or self._change.done():
            self._change = asyncio.get_running_loop().create_future()
        return self._change

    def _notify(self) -> None:
        if self._change is not None and not self._change.done():
            self._change.set_result(None)
