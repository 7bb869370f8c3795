"""GET /metrics: Prometheus text from one typed snapshot of the engine (`EngineSnapshot`) and
the app's own count of HTTP replies. The admin scope reads it.

The snapshot is taken once per scrape, so the figures of one scrape agree with each other
(the counters are copied under their lock); rendering it is a pure function, `render`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from quart import Blueprint, Response

from ..engine.worker import EngineSnapshot
from .auth import requires
from .context import state

bp = Blueprint("metrics", __name__)

CONTENT_TYPE = "text/plain; version=0.0.4"


@bp.get("/metrics")
@requires("admin")
async def metrics():
    """Prometheus text: queue, batch, models, generations, tokens, KV, speculative drafts, memory, HTTP replies"""
    s = state()
    return Response(render(s.engine.snapshot(), dict(s.http_statuses)), mimetype=CONTENT_TYPE)


def render(snap: EngineSnapshot, http_statuses: Mapping[int, int]) -> str:
    """The exposition text: a `# TYPE` line before each family, labelled series sorted by label."""
    lines = [
        *_gauge("lmsp_queue_depth", snap.queue_depth),
        *_gauge("lmsp_busy", int(snap.busy)),
        *_gauge("lmsp_batch_sequences", snap.batch_sequences),
        *_gauge("lmsp_batch_max", snap.batch_max),
        *_gauge("lmsp_distributed_ranks", snap.ranks),
        *_labelled_gauge("lmsp_distributed_rank_memory_bytes", "rank", enumerate(snap.rank_memory)),
        *_gauge("lmsp_models_loaded", snap.models_loaded),
        *_labelled("lmsp_requests_total", "status", snap.requests.items()),
        *_counter("lmsp_prompt_tokens_total", snap.prompt_tokens),
        *_counter("lmsp_output_tokens_total", snap.output_tokens),
        *_labelled("lmsp_kv_lookups_total", "source", snap.lookups.items()),
        *_counter("lmsp_kv_live_continuations_total", snap.live_continuations),
        *_labelled("lmsp_speculative_drafted_tokens_total", "drafter", snap.drafted.items()),
        *_labelled("lmsp_speculative_accepted_tokens_total", "drafter", snap.accepted.items()),
        *_gauge("lmsp_kv_sessions", snap.kv_sessions),
        *_gauge("lmsp_kv_resident_bytes", snap.kv_bytes),
        *_gauge("lmsp_mlx_active_bytes", snap.mlx_active_bytes),
        *_gauge("lmsp_mlx_cache_bytes", snap.mlx_cache_bytes),
        *([] if snap.memory.budget is None else _gauge("lmsp_memory_budget_bytes", snap.memory.budget)),
        *_labelled_gauge("lmsp_memory_held_bytes", "kind", [("weights", snap.memory.weights),
                                                            ("kv_reserved", snap.memory.kv_reserved),
                                                            ("kv_resident", snap.memory.kv_resident),
                                                            ("host", snap.memory.host)]),
        *_counter("lmsp_memory_waits_total", snap.memory.waits),
        *_labelled("lmsp_http_responses_total", "code", http_statuses.items()),
    ]
    return "\n".join(lines) + "\n"


def _gauge(name: str, value: int) -> list[str]:
    return [f"# TYPE {name} gauge", f"{name} {value}"]


def _counter(name: str, value: int) -> list[str]:
    return [f"# TYPE {name} counter", f"{name} {value}"]


def _labelled_gauge(name: str, label: str, series: Iterable[tuple[object, int]]) -> list[str]:
    """A gauge family with one series per label value; nothing where there are none."""
    rows = sorted(series)
    return [f"# TYPE {name} gauge", *(f'{name}{{{label}="{k}"}} {v}' for k, v in rows)] if rows else []


def _labelled(name: str, label: str, series: Iterable[tuple[object, int]]) -> list[str]:
    """A counter family with one series per label value."""
    return [f"# TYPE {name} counter", *(f'{name}{{{label}="{k}"}} {v}' for k, v in sorted(series))]
