"""How much memory a model directory takes once loaded, known before loading it, and how
much the machine has: a model that cannot fit is refused with both figures instead of the
process being killed by the kernel halfway through its load.

The estimate reads only the safetensors headers. On Metal and CUDA the weights stay as
stored. On the CPU build every weight becomes float32 (engine/loader.py), so a packed
4-bit weight takes 8 times its stored bytes and its scales and biases go; MoE experts
(`switch_mlp`) stay quantized, as the loader keeps them.
"""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from ..cache.disk import CheckpointError, read_header

_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1,
          "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
MARGIN = 0.10  # of the available memory, kept for the KV cache, activations and the rest of the process
MIN_MARGIN = 1 << 30
PROBE_STEP = 256  # tokens: mlx-lm's KVCache grows by this many at once


def estimate_bytes(path: Path, config: dict, backend: str, ranks: int = 1) -> int:
    """The model's weights after loading on `backend`, in bytes; with `ranks`, what one rank
    of a model split over them holds (engine/distributed.py): its share of the decoder
    layers (a slice of each, or a run of them) and the rest (embeddings, head) whole."""
    tables = {}
    for f in sorted(path.glob("*.safetensors")):
        try:
            tables.update(read_header(f)[0])
        except (OSError, CheckpointError):
            return sum(f.stat().st_size for f in path.glob("*.safetensors"))  # mlx-lm will say what is wrong
    layers = rest = 0
    group = (config.get("quantization") or {}).get("group_size", 64)
    for name, t in tables.items():
        size = _loaded_bytes(name, t, tables, backend, group)
        if _LAYER.search(name):
            layers += size
        else:
            rest += size
    return rest + math.ceil(layers / ranks)


_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.")


def _loaded_bytes(name: str, t: dict, tables: dict, backend: str, group: int) -> int:
    stored = math.prod(t["shape"]) * _BYTES.get(t["dtype"], 4)
    if backend != "cpu":
        return stored
    if "switch_mlp" in name or ".experts." in name:  # MoE experts stay quantized on the CPU
        return stored if t["dtype"] == "U32" else math.prod(t["shape"]) * 4
    if name.endswith((".scales", ".biases")) and name.rsplit(".", 1)[0] + ".weight" in tables:
        return 0  # folded into the float32 weight
    if name.endswith(".weight") and name[: -len("weight")] + "scales" in tables:
        scales = tables[name[: -len("weight")] + "scales"]["shape"]
        return math.prod(scales) * group * 4  # one float32 per weight: each scale covers `group`
    return math.prod(t["shape"]) * 4


def available_bytes() -> int | None:
    """Memory a new load can take now: Linux's MemAvailable; elsewhere the physical
    memory (on a Mac, Metal's working set is the limit that matters); None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if sys.platform == "darwin":
        import mlx.core as mx

        if mx.metal.is_available():
            return int(mx.metal.device_info().get("max_recommended_working_set_size", 0)) or None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def budget_bytes(override: int | None) -> tuple[int | None, str]:
    """What a load may take, and how that was found (for the refusal's line)."""
    if override is not None:
        return override, "--memory-budget-mb"
    available = available_bytes()
    if available is None:
        return None, ""
    margin = max(MIN_MARGIN, int(available * MARGIN))
    return max(0, available - margin), f"the available {gb(available)} less a {gb(margin)} margin"


def gb(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"  # as --memory-budget-mb counts


@dataclass(frozen=True)
class KVGrowth:
    """What one sequence's KV cache of a model takes: `fixed` bytes whatever its length
    (recurrent state, the first block) and `per_token` more for each token past it, the
    cache growing `step` tokens at a time (mlx-lm's KVCache allocates 256 at once). Measured
    (`kv_growth`), so every cache kind and dtype counts as it is: a sliding window's cache
    stops growing, so for it the estimate only errs high."""

    fixed: int
    per_token: int
    step: int = PROBE_STEP

    def bytes_for(self, tokens: int) -> int:
        blocks = max(0, math.ceil(tokens / self.step) - 1)
        return self.fixed + self.per_token * self.step * blocks


def kv_growth(lm) -> KVGrowth:
    """A model's KV growth, from its own cache filled to one token and to one block more
    (a forward of PROBE_STEP + 1 tokens, at load)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    def held(n: int) -> int:
        cache = make_prompt_cache(lm.model)
        lm.runner.prefill(mx.array([[1] * n]), cache)
        mx.eval([c.state for c in cache])
        return sum(c.nbytes for c in cache)

    one, more = held(1), held(PROBE_STEP + 1)
    return KVGrowth(one, max(0, more - one) // PROBE_STEP)
