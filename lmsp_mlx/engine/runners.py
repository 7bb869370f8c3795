"""How a step runs: the one seam between the engine and a model's forward pass.

The engine never calls a model itself. It asks the model's runner, chosen once at load
(`choose`, which logs it in one line), for the operations a step needs:
- `prefill(tokens, cache)`: a prompt chunk's K/V into `cache`, through the model's body
  only (no output head: its logits would be thrown away); `hidden` is that pass's output;
- `last_logits(tokens, cache)`: one sequence's logits after `tokens`, the head computed
  for the last position only;
- `forward(tokens, cache)`: the model's own pass, (B, L) tokens to (B, L, vocab) logits:
  a decode step of one sequence, or of many on a merged batch cache (engine/batch.py);
- `batch`: a compiled step that takes several sequences each on its own cache, or None
  where batching goes through merged caches.

Two runners:
- `MLXRunner`: every model on every backend; what Metal and CUDA run, and what the CPU
  runs for every model the compiled step does not take.
- `CompiledCPURunner`: llama-family float32 models on MLX's CPU backend (Linux), with
  the compiled decode step, batched step and prefill (cpu_decode.py, cpu_prefill.py).
  Whatever they do not take (a sliding-window cache, out-of-range ids) goes through MLX
  as in `MLXRunner`.
"""

from __future__ import annotations

import logging
from typing import ClassVar, Literal, Protocol

import mlx.core as mx
import mlx.nn as nn

from .cpu_decode import BatchStep, DecodeStep, decode_steps
from .cpu_prefill import PrefillPass, prefill_pass

log = logging.getLogger("lmsp_mlx.engine")

RunnerKind = Literal["mlx", "compiled-cpu"]


class Runner(Protocol):
    """What the engine runs a step through (see the module's docstring)."""

    kind: RunnerKind
    batch: BatchStep | None

    def forward(self, tokens: mx.array, cache: list) -> mx.array: ...

    def prefill(self, tokens: mx.array, cache: list) -> None: ...

    def hidden(self, *args, **kwargs) -> mx.array: ...

    def last_logits(self, tokens: list[int], cache: list) -> mx.array: ...

    def describe(self) -> str: ...


class _Body(nn.Module):
    """What the model's `model` attribute (its body) is for one pass through the runner:
    the body, run the runner's way (`run`), handing the output head only the last position
    where `last_only`.

    The pass that samples the first token runs the prompt's tail (up to 64 rows) through
    the whole model; the head is position-wise, so computing it for the one row that is
    sampled gives the same logits. For SmolLM2 the skipped rows were 20-25% of that pass
    (a 49k-row matmul per row), the time an agent waits for its first token."""

    def __init__(self, body: nn.Module, run, last_only: bool) -> None:
        super().__init__()
        self.body = body
        self._run, self._last_only = run, last_only

    def __call__(self, *args, **kwargs):
        out = self._run(*args, **kwargs)
        return out[:, -1:] if self._last_only and isinstance(out, mx.array) and out.ndim == 3 else out

    def __getattr__(self, key: str):
        if key == "body":
            return super().__getattr__(key)
        return getattr(self.body, key)  # e.g. tied heads use model.embed_tokens


class MLXRunner:
    """Every model, every backend: the model's own forward through MLX."""

    kind: ClassVar[RunnerKind] = "mlx"
    batch: BatchStep | None = None  # batched decode merges caches instead (engine/batch.py)

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        # mlx-lm models keep their body (embeddings and layers, no head) in `model`
        body = model.get("model")
        self.body: nn.Module | None = body if isinstance(body, nn.Module) else None

    def forward(self, tokens: mx.array, cache: list) -> mx.array:
        return self.model(tokens, cache=cache)

    def hidden(self, *args, **kwargs) -> mx.array:
        """The body's output (B, L, dim), called as the model calls its body (tokens first,
        then its cache and whatever else that model's body takes)."""
        return self.body(*args, **kwargs)

    def prefill(self, tokens: mx.array, cache: list) -> None:
        """Run `tokens` (1, n) into `cache` without the output head, where the model has a body."""
        if self.body is None:
            self.forward(tokens, cache)
        else:
            self.hidden(tokens, cache=cache)

    def last_logits(self, tokens: list[int], cache: list) -> mx.array:
        """Logits (1, vocab) after running `tokens` into `cache`, the head computed for the
        last token only."""
        if len(tokens) == 1 or self.body is None:
            return self.forward(mx.array([tokens]), cache)[:, -1, :]
        return self._through(mx.array([tokens]), cache, last_only=True)[:, -1, :]

    def _through(self, tokens: mx.array, cache: list, last_only: bool) -> mx.array:
        """The model's own pass with its body run as `hidden` runs it (see `_Body`); the
        model's body is put back before this returns."""
        self.model.model = _Body(self.body, self.hidden, last_only)
        try:
            return self.model(tokens, cache=cache)
        finally:
            self.model.model = self.body

    def describe(self) -> str:
        return "MLX (the model's own forward; batched decode on merged caches)"


class CompiledCPURunner(MLXRunner):
    """Llama-family float32 models on MLX's CPU backend: compiled steps, MLX for the rest."""

    kind: ClassVar[RunnerKind] = "compiled-cpu"

    def __init__(self, model: nn.Module, step: DecodeStep | None, batch: BatchStep | None,
                 chunk: PrefillPass | None) -> None:
        super().__init__(model)
        self.step, self.batch, self.chunk = step, batch, chunk

    def forward(self, tokens: mx.array, cache: list) -> mx.array:
        if self.step is not None and tokens.shape == (1, 1):
            logits = self.step(int(tokens.item()), cache)
            if logits is not None:
                return logits
        if self.chunk is not None and tokens.shape[0] == 1 and tokens.shape[1] > 1:
            return self._through(tokens, cache, last_only=False)
        return self.model(tokens, cache=cache)

    def hidden(self, *args, **kwargs) -> mx.array:
        # The models this runner takes (llama, qwen2) call their body as (inputs, cache, input_embeddings).
        bound = dict(zip(("tokens", "cache", "input_embeddings"), args), **kwargs)
        tokens, cache = bound.get("tokens"), bound.get("cache")
        if self.chunk is not None and cache is not None and bound.keys() <= {"tokens", "cache", "input_embeddings"} \
                and bound.get("input_embeddings") is None and tokens.shape[0] == 1 and tokens.shape[1] > 1:
            hidden = self.chunk(tokens, cache)
            if hidden is not None:
                return hidden
        return self.body(*args, **kwargs)

    def describe(self) -> str:
        parts = [what for what, on in (("decode step", self.step), ("batched step", self.batch),
                                       ("prefill", self.chunk)) if on is not None]
        return f"compiled CPU ({', '.join(parts)}: cpu_blas), MLX for the rest"


def choose(model: nn.Module, backend: str, name: str, distributed: bool = False) -> Runner:
    """The runner for `model` on `backend`, logged in one line: the compiled CPU runner
    where the CPU backend's compiled passes take the model, else the MLX runner. A model
    split over ranks runs on the MLX runner: its collectives are inside MLX's layers."""
    runner: Runner = MLXRunner(model)
    if backend == "cpu" and not distributed:
        steps = decode_steps(model)
        chunk = prefill_pass(model)
        if steps is not None or chunk is not None:
            step, batch = steps if steps is not None else (None, None)
            runner = CompiledCPURunner(model, step, batch, chunk)
    log.info("runner for %s: %s", name, runner.describe())
    return runner
