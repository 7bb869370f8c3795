"""The worker on every rank of a model split over ranks (engine/distributed.py), in step.

Each layer's collectives wait for every rank, so every rank must run the same steps on
the same sequences in the same order. Rank 0 serves HTTP; the others run the same worker
loop on mirrors of its jobs. At each step boundary rank 0 shares a `Tick`: the jobs that
join now (each as a `JobSpec`, what a job is without its event loop), the jobs that end
cancelled now, and whether the worker stops. Everything else a step decides follows from
the same jobs on the same state: which KV session a prompt starts from, which prompt
prefills, who decodes, the sampled tokens (the same logits on every rank, and the same
random state: `distributed.same_random_state`).

A job cancelled before it joins never reaches the others: rank 0 ends it alone. A job
cancelled while it runs ends on every rank at the same step boundary, not at the moment
its client left.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..protocol.routes import Route
from .distributed import Ranks, gather_memory, same_everywhere, same_random_state, share

MEMORY_EVERY = 40  # ticks between two readings of every rank's memory (for /metrics)
from .generate import GenerationParams
from .turn import Conversation


@dataclass(frozen=True)
class JobSpec:
    """A job as the other ranks need it: what runs, without where its events go. The
    grammar travels as its text (the compiled matcher is built again on each rank)."""

    id: int
    model: str
    params: GenerationParams  # its `constraint` is None here: see `grammar`
    grammar: str | None
    route: Route
    text: str
    visible: str | None
    keep_history: str | None
    conv: Conversation | None


@dataclass(frozen=True)
class Tick:
    joined: list[JobSpec] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)  # JobSpec ids whose runs end cancelled now
    stop: bool = False
    shed: tuple[tuple[str, int], ...] = ()  # (model, sessions): the idle sessions rank 0's memory budget evicted


class Lockstep:
    """Rank 0 says, the others follow (`agree`); ids number rank 0's jobs in order."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self._next_id = 0
        self._seeded = False
        self._ticks = 0
        self.memory: list[int] = []  # each rank's MLX active memory at the last reading, by rank

    @property
    def leads(self) -> bool:
        return self.ranks.rank == 0

    def next_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def barrier(self) -> None:
        """Until every rank reaches it (after the last checkpoint writes: rank 0 exits last)."""
        same_everywhere(0, self.ranks)

    def agree(self, tick: Tick | None) -> Tick:
        """Rank 0's `tick` on every rank (the others pass None). The first one also seeds
        every rank's random state alike, on the worker thread, before any sampling."""
        if not self._seeded:
            same_random_state(self.ranks)
            self._seeded = True
        quiet = tick is not None and not (tick.joined or tick.cancelled or tick.stop or tick.shed)
        agreed = share(None if quiet else tick, self.ranks) or Tick()  # most steps: one collective of 0
        if self._ticks % MEMORY_EVERY == 0:  # the same ticks on every rank: a collective they all reach
            self.memory = gather_memory(self.ranks)
        self._ticks += 1
        return agreed


def spec_of(job_id: int, model: str, params: GenerationParams, route: Route, text: str, visible: str | None,
            keep_history: str | None, conv: Conversation | None) -> JobSpec:
    grammar = params.constraint.grammar if params.constraint is not None else None
    return JobSpec(job_id, model, replace(params, constraint=None), grammar, route, text, visible, keep_history, conv)
