"""Compaction: POST /v1/responses/compact (and /lmsp/v1/responses/compact).

A long conversation becomes its user messages followed by one `compaction` item. The
item's sealed content names the conversation's rendered text (`history`, by hash) and
carries a summary the model wrote of it. The KV of that text is checkpointed (kind
`token`, keyed by the text) when the summary is generated.

A later request that carries the item continues the compacted conversation:
1. its text is known (compacted by this process, or found in the checkpoint): the items
   before the item are dropped (the history holds them), the items after it are rendered as
   the history's continuation, and the KV lookup finds the checkpoint (or the live session)
   by that text, so only the new items are prefilled;
2. otherwise (the checkpoint was evicted, another machine, `--no-kv-disk` after a restart),
   or when the request's instructions or tools differ from the compacted ones: the item
   becomes a user message holding the summary, and the request is rendered as usual.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from typing import Any

from ..cache.disk import SUFFIX, CheckpointStore, key_hash, read_header
from ..engine.render import continuation_text
from ..protocol.ids import new_id
from ..protocol.requests import CompactionItem, InputItem, MessageItem, ResponsesRequest
from ..protocol.responses import v1_usage
from .conversation import sealed_problem
from .sealing import Sealer, SealError

log = logging.getLogger("lmsp_mlx.server")

SUMMARY_REQUEST = (
    "Summarize the conversation so far for your own later use: the task, what has been done and found, "
    "decisions made, open questions, and the exact names, paths and values that will still matter. "
    "Write only the summary."
)
SUMMARY_TOKENS = 512
SUMMARY_PREFIX = "Summary of the earlier conversation:\n"


class Histories:
    """Conversations this process compacted, by the hash of their text (a bounded LRU),
    shared by the request handlers' threads."""

    def __init__(self, capacity: int = 64) -> None:
        self._texts: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self.capacity = capacity

    def remember(self, text: str) -> str:
        digest = key_hash(text)
        with self._lock:
            self._texts[digest] = text
            self._texts.move_to_end(digest)
            while len(self._texts) > self.capacity:
                self._texts.popitem(last=False)
        return digest

    def get(self, digest: str) -> str | None:
        with self._lock:
            return self._texts.get(digest)


def setup_digest(req: ResponsesRequest) -> str:
    """What the compacted text fixed besides the conversation: instructions and the tools
    it renders (none under tool_choice "none")."""
    tools = None if req.tool_choice == "none" else req.tools
    return hashlib.sha256(json.dumps([req.instructions, tools], sort_keys=True).encode()).hexdigest()


def seal(sealer: Sealer, req: ResponsesRequest, history: str, summary: str, histories: Histories) -> str:
    return sealer.seal("compaction", {"history": histories.remember(history), "summary": summary,
                                      "setup": setup_digest(req)})


def expand(items: list[InputItem], req: ResponsesRequest, sealer: Sealer, histories: Histories,
           disk: CheckpointStore | None, tokenizer, offset: int = 0) -> tuple[list[InputItem], str]:
    """The items to render and the compacted text they continue ("" for none). `offset`:
    how many items (a stored history) precede the request's own input, for error params."""
    opened = {i: _open(item, i, offset, sealer) for i, item in enumerate(items) if isinstance(item, CompactionItem)}
    if not opened:
        return items, ""
    last = max(opened)
    payload = opened[last]
    head = None
    if payload.get("setup") == setup_digest(req) and _continues(tokenizer):
        head = histories.get(payload.get("history", "")) or _from_checkpoint(payload.get("history", ""), disk)
    if head:
        log.info("compaction: continuing the compacted conversation (%d characters)", len(head))
        return items[last + 1:], head
    log.info("compaction: the compacted conversation is not available here; continuing from its summary")
    return [_summary(opened[i]) if i in opened else item for i, item in enumerate(items)], ""


def _open(item: CompactionItem, index: int, offset: int, sealer: Sealer) -> dict[str, Any]:
    try:
        return sealer.open("compaction", item.encrypted_content)
    except SealError as exc:
        raise sealed_problem(index, offset, "a compaction item", exc) from None


def _summary(payload: dict[str, Any]) -> MessageItem:
    return MessageItem(role="user", content=SUMMARY_PREFIX + str(payload.get("summary", "")))


def _continues(tokenizer) -> bool:
    """Whether this chat template renders new messages after an earlier conversation as a
    plain continuation (what resuming a compacted text needs)."""
    return continuation_text(tokenizer, [{"role": "user", "content": "x"}]) is not None


def _from_checkpoint(digest: str, disk: CheckpointStore | None) -> str | None:
    """The compacted text kept in its checkpoint (`key_text`), where that file is still there."""
    if disk is None or not digest:
        return None
    for kind in ("token", "visible"):
        try:
            _, meta = read_header(disk.dir / f"{kind}-{digest[:40]}{SUFFIX}")
        except (OSError, ValueError):
            continue
        text = meta.get("key_text")
        if meta.get("model") == disk.fingerprint and isinstance(text, str) and key_hash(text) == digest:
            return text
    return None


def compacted_object(items: list[InputItem], sealed: str, usage: Any) -> dict:
    """The `response.compaction` object: the user messages, then the compaction item."""
    users = [i for i in items if isinstance(i, MessageItem) and i.role == "user"]
    output = [{"id": i.id or new_id("msg"), "type": "message", "role": "user", "status": "completed",
               "content": [{"type": "input_text", "text": i.text()}]} for i in users]
    output.append({"id": new_id("cmp"), "type": "compaction", "encrypted_content": sealed, "created_by": "lmsp-mlx"})
    return {"id": new_id("resp"), "object": "response.compaction", "created_at": int(time.time()), "output": output,
            "usage": v1_usage(usage)}
