"""The Starlette app: OpenAI's routes over one `EngineWorker`.

A generation request is read and checked (protocol.py), tokenized off the event loop, checked
against the context, then queued; its events come back from the worker thread through an
asyncio queue. A client that disconnects sets its job's cancel event: the engine stops before
its next token (or never starts the job). Every error, ours or Starlette's (404, 405), is
answered in OpenAI's shape; an unexpected one is a 500 naming the exception, never a traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ember.models.support.errors import EmberError, PromptTooLong
from ember.offload.decode.events import TokenEvent

from .call_stream import CallStream
from .errors import ApiError
from .protocol import GenerationRequest, parse_chat, parse_completion
from .responses import FINISH_REASONS, Reply, logprobs_json, model_card
from .tools import apply_tools, parse_tools, split_calls
from .worker import EngineWorker, Failed, Finished, Job, QueueFull

log = logging.getLogger("ember.serve")
MAX_BODY_BYTES = 16 * 2**20
MAX_NESTING = 64  # JSON schemas and tool parameters nest a few levels; a body is not a stack
_GONE = object()  # put in a job's inbox when its client disconnects


class Api:
    def __init__(self, worker: EngineWorker, model_id: str, created: int = 0,
                 max_tokens: int | None = None):
        """`max_tokens`: the default for requests that set none (None: the rest of the
        context); any request is capped at what the context has left."""
        self.worker, self.engine = worker, worker.engine
        self.model_id, self.created, self.max_tokens = model_id, created, max_tokens

    # -- routes --------------------------------------------------------------------------
    async def health(self, request: Request) -> JSONResponse:
        s = self.worker.stats
        return JSONResponse({"status": "ok", "model": self.model_id, "busy": self.worker.busy,
                             "waiting": self.worker.waiting,
                             "queue_capacity": self.worker.max_queue, "finished": s.finished,
                             "cancelled": s.cancelled, "failed": s.failed})

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list",
                             "data": [model_card(self.model_id, self.created)]})

    async def model(self, request: Request) -> JSONResponse:
        name = request.path_params["name"]
        if name != self.model_id:
            raise ApiError(404, f"The model {name!r} does not exist", param="model",
                           code="model_not_found")
        return JSONResponse(model_card(self.model_id, self.created))

    async def chat(self, request: Request):
        body = await _json(request)
        req = parse_chat(body, self.model_id)
        req.tools = parse_tools(body)
        apply_tools(req, self.engine.tool_style, self.engine.tokenizer, self.model_id)
        return await self._generate(request, req)

    async def embeddings(self, request: Request):
        raise ApiError(404, f"This server has no embeddings: {self.model_id!r} is a chat model, "
                            "whose pooled hidden states make poor retrieval embeddings, and "
                            "computing them would occupy its one engine. Run an embedding "
                            "model elsewhere for /v1/embeddings.", param="model",
                       code="embeddings_not_supported")

    async def completions(self, request: Request):
        return await self._generate(request,
                                    parse_completion(await _json(request), self.model_id))

    # -- one generation --------------------------------------------------------------------
    async def _generate(self, request: Request, req: GenerationRequest):
        try:  # a schema compiles off the event loop (a first one builds the vocabulary's view)
            await run_in_threadpool(self.engine.check_sampling, req.sampling)
        except EmberError as exc:
            if getattr(exc, "setting", None) == "logit_bias":
                raise ApiError(400, str(exc), param="logit_bias") from None
            field = req.constrained_by or "tools"  # else the tools' call grammar
            raise ApiError(400, f"{field}: {exc}", param=field) from None
        prompt_ids = await run_in_threadpool(self._encode, req)
        room = self.engine.n_ctx - len(prompt_ids)
        loop, inbox = asyncio.get_running_loop(), asyncio.Queue()
        job = Job(prompt_ids, req.sampling, min(req.max_tokens or self.max_tokens or room, room),
                  deliver=lambda item: loop.call_soon_threadsafe(inbox.put_nowait, item),
                  stop=req.stop, ignore_eos=req.ignore_eos,
                  dropped_messages=getattr(prompt_ids, "dropped_messages", 0))
        try:
            self.worker.submit(job)
        except QueueFull as full:
            raise ApiError(429, f"The server is busy ({self.worker.max_queue} requests already "
                                f"wait for the engine); retry after {full.retry_after_s} s",
                           type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(full.retry_after_s)}) from None
        except EmberError as exc:  # shutting down
            raise ApiError(503, str(exc), type="server_error", code="unavailable") from None
        reply = Reply(req.kind, self.model_id)
        if req.stream:
            calls = (CallStream(req.tools.names, self.engine.tool_style)
                     if req.tools is not None else None)
            return StreamingResponse(self._sse(request, job, inbox, reply, req.include_usage,
                                               calls),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        watcher = asyncio.create_task(_watch_disconnect(request, job, inbox))
        logprobs = []
        try:
            while True:
                item = await inbox.get()
                if item is _GONE:  # nobody will read this answer
                    return JSONResponse({}, status_code=499)
                if isinstance(item, Failed):
                    raise _failure(item)
                if isinstance(item, TokenEvent) and item.logprob is not None:
                    logprobs.append((item.token_id, item.logprob))
                if isinstance(item, Finished):
                    wanted = req.sampling.logprobs is not None
                    calls = (split_calls(item.done.text, req.tools.names,
                                         self.engine.tool_style)
                             if req.tools is not None else None)
                    return JSONResponse(reply.whole(item, self._logprobs(reply, logprobs)
                                                    if wanted else None, calls))
        finally:
            job.cancel.set()  # nothing to stop once finished; stops the engine if we are cancelled
            watcher.cancel()

    async def _sse(self, request: Request, job: Job, inbox: asyncio.Queue, reply: Reply,
                   include_usage: bool, calls: CallStream | None = None):
        watcher = asyncio.create_task(_watch_disconnect(request, job, inbox))
        try:
            if reply.kind == "chat":
                yield _event(reply.chunk(first=True))
            pending, sent = [], 0  # logprobs not sent yet; text sent (completions' offsets)
            while True:
                item = await inbox.get()
                if item is _GONE:
                    return
                if isinstance(item, TokenEvent):
                    if item.logprob is not None:
                        pending.append((item.token_id, item.logprob))
                    items = ([("content", item.text)] if calls is None
                             else calls.push(item.text))
                    for kind, *piece in items:
                        if kind == "call":
                            yield _event(reply.call_chunk(*piece))
                        elif piece[0]:
                            yield _event(reply.chunk(piece[0], logprobs=self._logprobs(
                                reply, pending, sent) if pending else None))
                            pending, sent = [], sent + len(piece[0])
                    continue
                if isinstance(item, Finished):
                    finish = FINISH_REASONS[item.done.finish_reason]
                    if calls is not None:
                        for kind, *rest in calls.finish():
                            yield _event(reply.chunk(rest[0]) if kind == "content"
                                         else reply.call_chunk(*rest))
                        finish = "tool_calls" if calls.called else finish
                    yield _event(reply.chunk(finish=finish,
                                             logprobs=self._logprobs(reply, pending, sent)
                                             if pending else None))
                    if include_usage:
                        yield _event(reply.usage_chunk(item))
                elif isinstance(item, Failed):  # the status line has gone: the error in-band
                    yield _event(_failure(item).body())
                yield "data: [DONE]\n\n"
                return
        finally:
            job.cancel.set()
            watcher.cancel()

    def _logprobs(self, reply: Reply, entries: list, offset: int = 0) -> dict:
        tok = self.engine.tokenizer

        def spell(token: int) -> tuple[str, bytes]:
            raw = tok.token_bytes(token)  # a control token has no bytes: shown by its name
            return (raw.decode("utf-8", "replace") if raw else tok.token_text(token)), raw

        return logprobs_json(reply.kind, entries, spell, offset)

    def _encode(self, req: GenerationRequest) -> list[int]:
        """Prompt token ids; ApiError if they do not leave room for one generated token."""
        param = "messages" if req.kind == "chat" else "prompt"
        try:
            if isinstance(req.prompt, str) and req.kind == "completion":
                self.engine.check_text_fits([req.prompt])  # before tokenizing megabytes
            if req.kind == "chat":  # the oldest turns left out if it outgrew the context
                ids = self.engine.fit_chat(req.messages, req.max_tokens or self.max_tokens
                                           or self.engine.n_ctx,
                                           tools=req.tools.tools if req.tools else None)
            elif isinstance(req.prompt, str):
                ids = self.engine.encode(req.prompt)
            else:
                ids = list(req.prompt)
        except PromptTooLong as exc:  # the newest message alone does not fit
            raise ApiError(400, str(exc), param=param, code="context_length_exceeded") from None
        except EmberError as exc:  # e.g. a chat template that refuses these messages
            raise ApiError(400, str(exc), param=param) from None
        try:  # the engine's own rules (length, vocabulary), checked before any streaming
            self.engine.check_prompt(ids)
        except PromptTooLong as exc:
            raise ApiError(400, str(exc), param=param, code="context_length_exceeded") from None
        except EmberError as exc:
            raise ApiError(400, str(exc), param=param) from None
        return ids


def create_app(worker: EngineWorker, model_id: str, *, api_key: str | None = None,
               created: int = 0, max_tokens: int | None = None):
    """The ASGI app; with `api_key`, every route but /health wants `Authorization: Bearer`."""
    api = Api(worker, model_id, created, max_tokens)
    routes = [Route("/health", api.health, methods=["GET"]),
              Route("/v1/models", api.models, methods=["GET"]),
              Route("/v1/models/{name:path}", api.model, methods=["GET"]),
              Route("/v1/chat/completions", api.chat, methods=["POST"]),
              Route("/v1/completions", api.completions, methods=["POST"]),
              Route("/v1/embeddings", api.embeddings, methods=["POST"])]
    app = Starlette(routes=routes, exception_handlers={
        ApiError: _api_error, HTTPException: _http_error, Exception: _server_error})
    return app if api_key is None else ApiKeyCheck(app, api_key)


class ApiKeyCheck:
    """ASGI middleware: a 401 in OpenAI's shape unless the Bearer token is the key."""

    def __init__(self, app, api_key: str):
        self.app, self._key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                error = ApiError(401, "Incorrect or missing API key: send the server's "
                                      "--api-key as 'Authorization: Bearer KEY'",
                                 code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
                await _api_error(None, error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _json(request: Request):
    """The body as JSON: 413 as soon as it passes MAX_BODY_BYTES (read no further), 400 for
    anything that is not JSON or nests deeper than MAX_NESTING."""
    too_large = ApiError(413, f"the request body is over {MAX_BODY_BYTES // 2**20} MiB",
                         code="body_too_large")
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():  # a chunked body names no length: count it
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ApiError(400, f"We could not parse the JSON body of your request ({reason})",
                       code="invalid_json") from None
    if nesting(body) > MAX_NESTING:
        raise ApiError(400, f"the JSON body nests deeper than {MAX_NESTING} levels",
                       code="invalid_json")
    return body


def nesting(value) -> int:
    """How deep lists and objects nest in `value`, counted without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        children = (item.values() if isinstance(item, dict) else item
                    if isinstance(item, list) else ())
        if children:
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in children)
    return deepest


async def _watch_disconnect(request: Request, job: Job, inbox: asyncio.Queue) -> None:
    """Wait for the client to go away, then cancel its job and wake whoever waits for it."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel.set()
    inbox.put_nowait(_GONE)


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _failure(item: Failed) -> ApiError:
    if isinstance(item.error, EmberError):
        return ApiError(400, str(item.error))
    return ApiError(500, f"The engine failed ({type(item.error).__name__}); the server log has "
                         "the details", type="server_error", code="engine_error")


def _api_error(request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _http_error(request, exc: HTTPException) -> JSONResponse:
    method = request.method if request is not None else ""
    path = request.url.path if request is not None else ""
    error = ApiError(exc.status_code, f"{exc.detail}: {method} {path}",
                     code="not_found" if exc.status_code == 404 else None,
                     headers=dict(exc.headers or {}))
    return _api_error(request, error)


def _server_error(request, exc: Exception) -> JSONResponse:
    log.error("request failed: %s: %s", type(exc).__name__, exc)
    return _api_error(request, ApiError(500, f"Internal error ({type(exc).__name__})",
                                        type="server_error", code="internal_error"))
