"""One response from request to result, shared by the LMSP and /v1 routes.

`ResponseRun` validates what the model can do, renders and measures the prompt, queues the
job, and folds the worker's events into the response object; the routes only choose the
framing (sync JSON, LMSP SSE, Open Responses SSE).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Callable

from pydantic import TypeAdapter

from ..engine.events import Failed, Finished
from ..engine.generate import GenerationParams
from ..engine.constrain import Constraint, GrammarError
from ..engine.grammar import ReplySpec, full_grammar
from ..engine.output import OutputFormat
from ..engine.render import render, render_hidden
from ..engine.worker import Engine
from ..protocol.ids import new_id
from ..protocol.problems import Problem
from ..protocol.requests import InputItem, ResponsesRequest
from ..store.responses import Stored
from ..protocol.responses import IncompleteDetails, InputTokensDetails, ResponseObject, ResponseUsage
from .auth import owner
from .conversation import open_reasoning, prepare
from .items import ItemEvent, ItemFolder
from .sealing import Sealer

log = logging.getLogger("lmsp_mlx.server")


def check_capabilities(req: ResponsesRequest, capabilities: tuple[str, ...]) -> None:
    """400 `unsupported_capability` for what this model/service cannot do (yet)."""
    fmt = req.response_format
    if fmt is None and req.text and isinstance(req.text.get("format"), dict):
        fmt_type, where = req.text["format"].get("type", "text"), "text.format"
    else:
        fmt_type, where = (fmt.type if fmt else "text"), "response_format"
    if fmt_type != "text" and "structured_output" not in capabilities:
        raise Problem(
            "unsupported_capability",
            f"response_format {fmt_type!r} needs the 'structured_output' capability this model lacks",
            param=where,
        )
    if req.previous_response_id is not None and "conversations" not in capabilities:
        raise Problem(
            "unsupported_capability",
            "previous_response_id needs the 'conversations' capability this service lacks",
            param="previous_response_id",
        )


class ResponseRun:
    """`req` is the request as sent; `history` the stored conversation its
    `previous_response_id` names, rendered before its input. `keep`, when the response is
    to be stored, is called once it has ended. `sealer` opens sealed reasoning in the input
    and, on /v1 with `include: ["reasoning.encrypted_content"]`, seals the reasoning out."""

    def __init__(self, engine: Engine, req: ResponsesRequest, route: str, prefill_step: int, sealer: Sealer,
                 history: list[InputItem] | None = None, keep: Callable[["ResponseRun"], None] | None = None) -> None:
        lm = engine.model
        assert lm is not None
        if req.model != lm.id:
            raise Problem("model_not_found", f"model {req.model!r} is not served here; try {lm.id!r}", param="model")
        check_capabilities(req, lm.capabilities)
        self.engine = engine
        self.req = req
        self.route = route
        self.prefill_step = prefill_step
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.completed_at: int | None = None
        self.status = "in_progress"
        self.sealer = sealer
        sealed = route == "v1" and "reasoning.encrypted_content" in (req.include or [])
        self.folder = ItemFolder(seal=(lambda raw: sealer.seal("reasoning", {"raw": raw})) if sealed else None)
        self.usage: ResponseUsage | None = None
        self.incomplete_reason: str | None = None
        self.error: dict | None = None
        self.job = None
        self.limited_by_context = False
        self.history = history or []
        self.keep = keep

    async def start(self) -> None:
        """Render and measure the prompt (off the event loop), then queue the job."""
        lm = self.engine.model
        open_reasoning(self.req.items(), self.sealer)  # the same item objects `prepare` sees
        full = self.req.model_copy(update={"input": self.history + self.req.items()}) if self.history else self.req
        conv, spec = prepare(full, self.route, lm.tokenizer, self.engine.calls, "reasoning" in lm.capabilities)
        messages = conv.messages(self.engine.calls)
        prompt = await asyncio.to_thread(render, lm.tokenizer, messages, conv.template_tools())
        visible, hidden = None, []
        revealed = conv.messages(self.engine.calls, hidden=hidden)
        if hidden:  # sealed reasoning came back: the prompt is the true history, as the KV held it
            true = await asyncio.to_thread(render_hidden, lm.tokenizer, revealed, hidden, conv.template_tools())
            if true is None:
                log.warning("this chat template does not keep a turn's content where hidden reasoning goes; "
                            "the visible history is rendered")
            else:
                visible, prompt = prompt.text, true
        constraint = await asyncio.to_thread(self._constraint, spec, prompt.text) if spec else None
        n, ctx = len(prompt.tokens), lm.context_length
        if n >= ctx:
            raise Problem(
                "context_length_exceeded",
                f"the prompt has {n} tokens but the model's context is {ctx} tokens "
                "(at least one must remain for the output)",
                param="input",
            )
        room = ctx - n
        self.limited_by_context = self.req.max_output_tokens is None or self.req.max_output_tokens > room
        params = GenerationParams(
            prompt=prompt.tokens,
            max_tokens=min(self.req.max_output_tokens or room, room),
            temperature=1.0 if self.req.temperature is None else self.req.temperature,
            top_p=1.0 if self.req.top_p is None else self.req.top_p,
            prefill_step=self.prefill_step,
            constraint=constraint,
        )
        self.job = self.engine.submit(params, self.route, text=prompt.text, conv=conv, visible=visible)

    def _constraint(self, spec: ReplySpec, prompt_text: str) -> Constraint | None:
        """The reply's grammar, compiled before any generation (a failure is a 400)."""
        tokenizer = self.engine.model.tokenizer
        fmt = OutputFormat.of(tokenizer)
        lark = full_grammar(spec, fmt, fmt.opens_in_reasoning(prompt_text), tokenizer)
        if lark is None:
            log.info("the reply constraint (%s) cannot be expressed for this model's call syntax: not enforced", spec.kind)
            return None
        try:
            return Constraint(tokenizer, lark)
        except GrammarError as exc:
            where = "tools" if spec.kind in ("call", "calls") else "response_format"
            raise Problem("invalid_request", f"the reply's constraint cannot be compiled: {exc}", param=where) from None

    async def events(self) -> AsyncIterator[ItemEvent]:
        """Item-level events as the worker produces them; the final state is set at the end."""
        async for event in self.job.stream():
            if isinstance(event, Finished):
                for e in self.folder.close(ensure_message=event.reason != "cancelled"):
                    yield e
                u = event.usage
                self.usage = ResponseUsage(
                    input_tokens=u.input_tokens, output_tokens=u.output_tokens, total_tokens=u.total_tokens,
                    input_tokens_details=InputTokensDetails(cached_tokens=u.cached_tokens),
                )
                if event.reason == "length":
                    self.status = "incomplete"
                    self.incomplete_reason = "context_length" if self.limited_by_context else "max_output_tokens"
                elif event.reason == "cancelled":
                    self.status = "cancelled"
                else:
                    self.status = "completed"
            elif isinstance(event, Failed):
                self.status = "failed"
                self.error = Problem(event.code, event.message).document()
            else:
                for e in self.folder.feed(event):
                    yield e
        self.completed_at = int(time.time())
        if self.keep is not None:
            await asyncio.to_thread(self.keep, self)

    def stored_request(self) -> dict[str, Any]:
        """The request as the store keeps it: its own input items, not the history before them."""
        return {**self.req.model_dump(mode="json", exclude_none=True),
                "input": [item.model_dump(mode="json", exclude_none=True) for item in self.req.items()]}

    def cancel(self) -> None:
        """The client left: stop the worker at its next prefill chunk or decode step."""
        if self.job is not None and self.status == "in_progress":
            self.job.cancel()

    def response(self) -> ResponseObject:
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            status=self.status,
            model=self.req.model,
            output=self.folder.snapshot() if self.status != "in_progress" else [],
            usage=self.usage,
            error=self.error,
            incomplete_details=IncompleteDetails(reason=self.incomplete_reason) if self.incomplete_reason else None,
        )

    async def run_to_end(self) -> ResponseObject:
        """Synchronous mode; a failed generation is a problem document, not a response object."""
        try:
            async for _ in self.events():
                pass
        finally:
            self.cancel()
        if self.status == "failed":
            raise Problem(self.error["code"], self.error["detail"])
        return self.response()


_ITEMS = TypeAdapter(list[InputItem])


async def stored_response(response_id: str) -> Stored:
    """A response the caller's token stored; 404 `response_not_found` otherwise."""
    from .state import state

    found = await asyncio.to_thread(state().responses.get, owner(), response_id)
    if found is None:
        raise Problem("response_not_found", f"no stored response {response_id!r}")
    return found


async def start_run(route: str, req: ResponsesRequest, local: dict[str, Stored] | None = None) -> ResponseRun:
    """Queue a request's generation, its stored history first: the common start of every
    route. `local`: a WebSocket connection's own responses, which chain with
    previous_response_id even when not stored; each finished run is added to it."""
    from .state import state

    s, who = state(), owner()
    history = None
    if req.previous_response_id is not None:
        items = await asyncio.to_thread(s.responses.conversation, who, req.previous_response_id, local)
        if items is None:
            raise Problem("response_not_found", f"no stored response {req.previous_response_id!r}",
                          param="previous_response_id")
        history = _ITEMS.validate_python(items)

    def keep(run: ResponseRun) -> None:
        done = Stored(run.stored_request(), run.response().model_dump(mode="json"), run.completed_at)
        if local is not None:
            local[run.id] = done
        if req.store:
            s.responses.put(who, done.request, done.response, done.completed_at)

    run = ResponseRun(s.engine, req, route, s.settings.prefill_step, s.sealer, history,
                      keep if req.store or local is not None else None)
    await run.start()
    return run
