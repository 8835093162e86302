"""The router's FastAPI app: routes, error handlers and auth, over one RouterContext (context.py).

Routes: POST /v1/completions, POST /v1/chat/completions, POST /tokenize and /detokenize (vLLM's),
GET /v1/models, GET /health (live; /ping
too, as vLLM), GET /version, GET /ready (a scheduler answers Ping with ready=True), GET /metrics (Prometheus), GET /v1/kv (the
block store's stats), GET /v1/requests/{id}, POST /v1/requests/{id}/cancel (and DELETE
/v1/requests/{id}): any router can report on or cancel a request made through another one.
Every error, FastAPI's own included, leaves in the OpenAI shape (services.router.errors).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.services.router.chat import ChatEndpoint
from pagedserve.services.router.completions import CompletionEndpoint
from pagedserve.services.router.context import RouterContext, server_version
from pagedserve.services.router.errors import APIError, error_body
from pagedserve.services.router.event_stream import RouterApp
from pagedserve.services.router.guard import Guard
from pagedserve.services.router.metrics import CONTENT_TYPE
from pagedserve.services.router.model_info import ModelInfo
from pagedserve.services.router.openai_schema import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                     TokenizeRequest, openapi_body, validation_error)
from pagedserve.services.router.pipeline import generate
from pagedserve.services.router.tokenization import detokenize, tokenize
from pagedserve.services.state import StateStore

log = logging.getLogger("pagedserve.router")

# What a request's record holds for the routers alone: where it runs, and its ids there.
INTERNAL_RECORD_FIELDS = frozenset({"replica_endpoint", "backend_ids"})


def create_app(config, info: ModelInfo, state: StateStore) -> FastAPI:
    ctx = RouterContext(config, info, state)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx.start()
        try:
            yield
        finally:
            await ctx.stop()

    app = RouterApp(title="pagedserve router", lifespan=lifespan)
    app.state.ctx = ctx
    # Added first, so it runs inside CORS: a 401 still carries the CORS headers a browser needs.
    app.add_middleware(Guard, config=config, state=state, on_error=ctx.metrics.error)
    app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=config.allowed_methods,
                       allow_headers=config.allowed_headers, allow_credentials=config.allow_credentials)

    # ---- errors ------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        ctx.metrics.error(exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        ctx.metrics.error(400)
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        if type(exc).__module__.startswith("redis"):   # the shared state is down: the router cannot serve
            log.error("shared state unavailable on %s: %s", request.url.path, exc)
            ctx.metrics.error(503)
            return JSONResponse(error_body(503, f"shared state unavailable: {exc}"), status_code=503)
        log.exception("unhandled error on %s", request.url.path)
        ctx.metrics.error(500)
        # Starlette re-raises after this response and the server then drops the connection: say
        # so, or a keep-alive client would send its next request into a closed socket.
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500,
                            headers={"Connection": "close"})

    # ---- generation (pipeline.py: the steps both share; each endpoint's own part is its Endpoint) --
    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request):
        return await generate(ctx, request, CompletionEndpoint)

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await generate(ctx, request, ChatEndpoint)

    # vLLM's tokenizer routes: outside /v1, and (as vLLM's) not behind the API key.
    @app.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
    async def tokenize_route(request: Request):
        return JSONResponse(await tokenize(ctx, request))

    @app.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
    async def detokenize_route(request: Request):
        return JSONResponse(await detokenize(ctx, request))

    @app.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": int(time.time()), "owned_by": "pagedserve",
            "root": ctx.info.path, "parent": None, "max_model_len": ctx.info.max_model_len}
            for name in sorted(ctx.served_names)]}

    # ---- health and stats --------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    # vLLM's /ping (SageMaker's liveness check) answers as /health does, to GET and POST.
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/version")
    async def version():
        return {"version": server_version()}

    @app.get("/ready")
    async def ready():
        targets = ctx.backends.targets()
        pongs = await asyncio.gather(*(ctx.backends.client(ep).ping(ctx.config.ready_timeout_s)
                                       for _, ep in targets))
        ready_ids = [rid for (rid, _), p in zip(targets, pongs) if p is not None and p.ready]
        body = {"status": "ready" if ready_ids else "not ready", "replicas": len(targets),
                "ready_replicas": ready_ids}
        return JSONResponse(body, status_code=200 if ready_ids else 503)

    @app.get("/metrics")
    async def metrics():
        stats = [s for _, s in await ctx.engine_stats()]
        return Response(ctx.metrics.expose(stats), media_type=CONTENT_TYPE)

    @app.get("/v1/kv")
    async def kv(request: Request):
        stats = await ctx.engine_stats()
        if not stats:
            raise APIError(503, "no engine replica answered GetStats")
        if ctx.config.scheduler_endpoint:
            return stats[0][1].get("kv", {})
        return {rid: s.get("kv", {}) for rid, s in stats}

    # ---- request records ---------------------------------------------------------------------
    # Records are scoped to the API key that made them (RouterContext.record_id); what leaves is
    # their public part: the engine's address and the backend ids stay inside.
    def _record(request: Request, request_id: str) -> tuple[str, dict]:
        scoped = ctx.record_id(request, request_id)
        record = ctx.state.get_request(scoped)
        if record is None:
            raise APIError(404, f"no request {request_id!r} (unknown, or its record expired)", "request_id")
        return scoped, record

    def _public(record: dict, request_id: str) -> dict:
        return {**{k: v for k, v in record.items() if k not in INTERNAL_RECORD_FIELDS}, "request_id": request_id}

    @app.get("/v1/requests/{request_id}")
    async def get_request(request_id: str, request: Request):
        return _public(_record(request, request_id)[1], request_id)

    async def _cancel(request_id: str, request: Request):
        scoped, record = _record(request, request_id)
        if record.get("status") != "running":
            return _public(record, request_id)
        client = ctx.backends.client(record["replica_endpoint"])
        try:
            for bid in record.get("backend_ids") or [request_id]:
                await client.abort(bid)
        except Exception as e:   # SchedulerUnavailable: the replica is gone, and its requests with it
            raise APIError(503, f"could not reach the request's engine: {e}") from None
        ctx.state.update_request_status(scoped, "cancelled", cancelled_by=ctx.router_id)
        return _public(_record(request, request_id)[1], request_id)

    app.add_api_route("/v1/requests/{request_id}/cancel", _cancel, methods=["POST"])
    app.add_api_route("/v1/requests/{request_id}", _cancel, methods=["DELETE"])
    return app
