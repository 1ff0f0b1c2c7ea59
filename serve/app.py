"""The Tinker API over HTTP: FastAPI routes that turn each call into serve/service.py's operations.

The endpoints and bodies are those the `tinker` SDK sends (checked against tinker 0.38.0): all under
`/api/v1`, JSON except forward_backward's request and the forward_backward and sample results
(protobuf, serve/wire.py). Calls that run on the model answer at once with a future's id
(`{"request_id"}`); the SDK then polls `retrieve_future`, which waits up to `poll_s` for the
result and otherwise answers 408 `{"type": "try_again", "queue_state": "active"}` (the SDK polls
again at once; its own read timeout is 45 s, so `poll_s` stays well below).

Every request must carry the service's API key in `X-API-Key` (compared in constant time; 401
without it). Bodies over `max_body_bytes` get 413. A malformed or wrong request gets 400 with the
SDK's error form `{"error", "category": "user"}`; a request that fails once queued resolves its
future to that form; either way the service goes on serving.

The listings of training runs, checkpoints and sessions are serve/runs.py's. A route the service
does not have (the Tinker cloud's publishing, TTLs, external weights, copies, billing, audit log,
projects, traces) answers 404 in the SDK's error form, saying it is not served by Tandem.

The `client/config` answer switches off what this service does not implement (JWT exchange,
zstd-compressed bodies, the session futures poller, server-side custom losses) and sets the
SDK's forward_backward chunk size to `chunk_datums`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from serve import runs
from serve.service import RETRIEVED_KEEP_S, Service
from serve.store import NotFound, parse_path
from serve.trainer import LoraChoice, UserError
from serve.wire import WireError, decode_forward_backward

log = logging.getLogger("tandem.tinker")
PROTO = "application/x-protobuf"


def user_error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": message, "category": "user"}, status_code=status)


def make_app(service: Service, api_key: str, chunk_datums: int = 1024, poll_s: float = 20.0,
             max_body_bytes: int = 64 << 20, max_tokens: int = 4096) -> FastAPI:
    """The FastAPI app serving `service` to callers holding `api_key`."""
    from tinker import types

    app = FastAPI(title="Tandem Tinker service", docs_url=None, redoc_url=None, openapi_url=None)
    key = api_key.encode()

    @app.middleware("http")
    async def guard(request: Request, call_next):
        given = request.headers.get("x-api-key", "").encode()
        if not hmac.compare_digest(given, key):
            return user_error("missing or wrong API key (X-API-Key)", 401)
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > max_body_bytes):
            return user_error(f"body of {size} bytes; the limit is {max_body_bytes}", 413)
        if request.headers.get("content-encoding", "identity") != "identity":
            return user_error("compressed bodies are not accepted (client/config says so)", 415)
        return await call_next(request)

    @app.exception_handler(UserError)
    @app.exception_handler(WireError)
    async def refused(request: Request, exc: Exception):
        return user_error(str(exc), 404 if isinstance(exc, NotFound) else 400)

    @app.exception_handler(ValidationError)
    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, exc: ValidationError | RequestValidationError):
        errors = exc.errors(include_url=False) if isinstance(exc, ValidationError) else exc.errors()
        return user_error(f"malformed request: {list(errors)[:3]}")

    @app.exception_handler(HTTPException)
    async def not_served(request: Request, exc: HTTPException):  # the router's 404 and 405
        if exc.status_code not in (404, 405):
            return user_error(str(exc.detail), exc.status_code)
        return user_error(f"{request.method} {request.url.path} is not served by Tandem's Tinker service (publishing, "
                          "checkpoint TTLs, external weights, copies, billing, audit logs, projects and traces "
                          "belong to the Tinker cloud; docs/tinker.md lists what is served)", 404)

    async def read_json(request: Request) -> dict:
        body = await request.body()
        if len(body) > max_body_bytes:
            raise UserError(f"body of {len(body)} bytes; the limit is {max_body_bytes}")
        try:
            data = json.loads(body or b"{}")
        except ValueError as exc:
            raise UserError(f"the body is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise UserError("the body must be a JSON object")
        return data

    async def parse(request: Request, model):
        return model.model_validate(await read_json(request))

    def future(rid: str, **extra) -> dict:
        return {"request_id": rid, **extra}

    # -- service -----------------------------------------------------------------
    @app.post("/api/v1/client/config")
    async def client_config():
        return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False, "use_pyqwest_transport": False,
                "parallel_fwdbwd_chunks": True, "fwdbwd_max_chunk_len": chunk_datums,
                "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
                "sample_join_sampling_session": False}

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config():
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.get("/api/v1/healthz")
    async def healthz():  # with what the service holds: finished sessions' clients are freed
        live = sum(s["finished"] is None for s in list(service.sessions.values()))
        return {"status": "ok", "live_sessions": live, "training_clients": len(service.models),
                "adapters": len(service.trainer.specs), "optimizers": len(service.trainer.optimizers),
                "sampling_sessions": len(service.samplers)}

    @app.post("/api/v1/get_server_capabilities")
    @app.get("/api/v1/get_server_capabilities")
    async def capabilities():
        context = getattr(service.trainer.base.config, "max_position_embeddings", None)
        return {"supported_models": [{"model_name": name, "max_context_length": context, "trainable": True,
                                      "sampleable": True} for name in (service.model_path, service.model_name)]}

    @app.post("/api/v1/telemetry")
    async def telemetry():
        return {"status": "accepted"}  # received and dropped: this service keeps no telemetry

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        req = await parse(request, types.CreateSessionRequest)
        return {"type": "create_session",
                "session_id": service.create_session(req.user_metadata, req.display_name)}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        req = await parse(request, types.SessionHeartbeatRequest)
        session = service.session(req.session_id)
        if session["finished"] is not None:
            return user_error(f"session {req.session_id} has finished", 410)
        session["heartbeat"] = time.time()
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        body = await read_json(request)
        reason = body.get("reason")
        service.finish_session(session_id, reason.get("type", "success") if isinstance(reason, dict) else "success")
        return Response(status_code=200)

    # -- training ------------------------------------------------------------------
    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        req = await parse(request, types.CreateModelRequest)
        service.live(req.session_id)
        service.check_base(req.base_model)
        if getattr(req.optimizer_config, "type", "adamw") != "adamw":
            raise UserError(f"optimizer {req.optimizer_config.type!r}: this service trains with adamw only")
        lora = req.lora_config or types.LoraConfig(rank=32)
        choice = LoraChoice(rank=lora.rank, seed=lora.seed, train_mlp=lora.train_mlp, train_attn=lora.train_attn,
                            train_unembed=lora.train_unembed)
        rid = service.submit(service.create_model_job(req.session_id, req.model_seq_id, choice, req.user_metadata),
                             key=("create", req.session_id, req.model_seq_id))
        return future(rid)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        req = await parse(request, types.GetInfoRequest)
        return service.info(req.model_id)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        from serve.wire import encode_forward_backward

        body = await request.body()
        try:
            req = decode_forward_backward(body)
            error = None
        except WireError as exc:  # the header may still name the model: fail that seq_id, in order
            from tinker.proto import tinker_public_pb2 as pb

            req, error = pb.ForwardBackwardRequest(), str(exc)
            try:
                req.ParseFromString(body)
            except Exception:  # noqa: BLE001 - not a request at all
                raise UserError(error) from None
        model = service.model(req.model_id)

        def job():
            if error is not None:
                raise UserError(error)
            logprobs, metrics = service.trainer.forward_backward(model.adapter, req.data, req.loss_fn, req.config,
                                                                 req.forward_only)
            return encode_forward_backward(logprobs, metrics)
        return future(service.submit_ordered(req.model_id, req.seq_id, job), model_id=req.model_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        body = await read_json(request)
        params = body.get("adam_params")
        if not isinstance(params, dict):
            other = body.get("optimizer_params")
            kind = other.get("type") if isinstance(other, dict) else None
            raise UserError(f"optim_step needs adam_params (this service trains with Adam); got {kind or body!r}")
        req = types.OptimStepRequest.model_validate(body)
        model = service.model(req.model_id)
        adam = req.optim_params.model_dump()

        def job():
            return {"metrics": service.trainer.optim_step(model.adapter, adam)}
        return future(service.submit_ordered(req.model_id, req.seq_id, job), model_id=req.model_id)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        req = await parse(request, types.SaveWeightsRequest)
        service.model(req.model_id)

        def job():
            return {"type": "save_weights", "path": service.save(req.model_id, req.path, "weights", optimizer=True)}
        return future(service.submit_ordered(req.model_id, req.seq_id, job), model_id=req.model_id)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request):
        req = await parse(request, types.SaveWeightsForSamplerRequest)
        service.model(req.model_id)
        session = req.model_id.split(":train:")[0]

        def job():
            if req.path is not None:
                path = service.save(req.model_id, req.path, "sampler_weights", optimizer=False)
                return {"type": "save_weights_for_sampler", "path": path}
            sampler_id = f"{session}:sample:{req.sampling_session_seq_id}"
            service.add_sampler(sampler_id, None, service.snapshot(req.model_id))
            return {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id}
        return future(service.submit_ordered(req.model_id, req.seq_id, job), model_id=req.model_id)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        req = await parse(request, types.LoadWeightsRequest)
        parse_path(req.path)
        if req.model_id is not None:  # load_state onto an existing model, in its order
            service.model(req.model_id)

            def job():
                service.load_into(req.model_id, req.path, req.optimizer)
                return {"type": "load_weights", "path": req.path, "model_id": req.model_id}
            return future(service.submit_ordered(req.model_id, req.seq_id, job), model_id=req.model_id)
        if req.session_id is None or req.model_seq_id is None:
            raise UserError("load_weights needs model_id and seq_id, or session_id and model_seq_id")
        service.live(req.session_id)
        service.check_base(req.base_model)
        job = service.create_model_from_state_job(req.session_id, req.model_seq_id, req.path, req.optimizer)
        return future(service.submit(job, key=("create", req.session_id, req.model_seq_id)))

    # -- sampling ------------------------------------------------------------------
    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        req = await parse(request, types.CreateSamplingSessionRequest)
        service.live(req.session_id)
        if req.model_path is None:
            service.check_base(req.base_model)
            if req.base_model is None:
                raise UserError("create_sampling_session needs model_path or base_model")
        sampler_id = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        if sampler_id not in service.samplers:
            service.add_sampler(sampler_id, req.model_path, service.weights_of(req.model_path))
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str):
        s = service.samplers.get(sampler_id)
        if s is None:
            return user_error(f"no sampling session {sampler_id!r}", 404)
        return {"sampler_id": sampler_id, "base_model": service.model_path, "model_path": s.model_path}

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        from actors.engine import SamplingParams
        from serve.wire import encode_sample

        req = await parse(request, types.SampleRequest)
        if req.sampling_session_id is not None:
            session = service.sampling(req.sampling_session_id)
            weights = session.weights
        else:
            if req.model_path is None:
                service.check_base(req.base_model)
            session, weights = None, service.weights_of(req.model_path)
        prompt: list[int] = []
        for chunk in req.prompt.chunks:
            if not isinstance(chunk, types.EncodedTextChunk):
                raise UserError(f"a prompt chunk of type {chunk.type!r}; this service samples from tokens only")
            prompt.extend(int(t) for t in chunk.tokens)
        vocab = service.trainer.vocab
        bad = [t for t in prompt if not 0 <= t < vocab]
        if not prompt or bad:
            raise UserError(f"the prompt holds token id {bad[0]}, outside the vocabulary [0, {vocab})" if bad
                            else "the prompt is empty")
        p = req.sampling_params
        n, limit = req.num_samples, p.max_tokens if p.max_tokens is not None else 64
        if not 1 <= n <= 256 or not 1 <= limit <= max_tokens:
            raise UserError(f"num_samples must be 1..256 and max_tokens 1..{max_tokens}; got {n} and {limit}")
        if req.topk_prompt_logprobs or req.topk_sample_logprobs or req.target_prompt_logprobs is not None \
                or req.prompt_alt_tokens_k or req.prompt_logprobs_last_n is not None:
            raise UserError("top-k, target and partial prompt log-probs and prompt alternatives are not "
                            "served here; ask for prompt_logprobs (compute_logprobs) or sampled log-probs")
        try:  # refused now, not in the worker
            service.sampler.stop_ids(p.stop)
            service.sampler.check_length(len(prompt), limit)
            SamplingParams(limit, (), temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        if p.temperature < 0:
            raise UserError(f"temperature must be at least 0, got {p.temperature}")

        def job():
            seqs, prompt_lp = service.sampler.sample(weights, prompt, n, limit, p.temperature, p.top_k, p.top_p,
                                                     p.stop, p.seed, bool(req.prompt_logprobs))
            return encode_sample(seqs, prompt_lp)
        key = None if session is None or req.seq_id is None else ("sample", req.sampling_session_id, req.seq_id)
        rid = service.submit(job, key=key)
        return future(rid, sample_sequence_ids=[f"{rid}:{i}" for i in range(n)])

    # -- training runs, checkpoints, sessions (plain functions: FastAPI runs them off the event loop) --
    @app.get("/api/v1/training_runs")
    def list_training_runs(limit: int = 20, offset: int = 0, access_scope: str = "owned",
                           project_id: str | None = None):
        runs.check_scope(access_scope, project_id)
        return runs.training_runs(service, limit, offset)

    @app.get("/api/v1/training_runs/{run_id}")
    def get_training_run(run_id: str, access_scope: str = "owned"):
        runs.check_scope(access_scope)
        return runs.training_run(service, run_id)

    @app.get("/api/v1/training_runs/{run_id}/checkpoints")
    def list_checkpoints(run_id: str):
        return runs.checkpoints(service, run_id)

    @app.get("/api/v1/checkpoints")
    def list_user_checkpoints(limit: int = 100, offset: int = 0):
        return runs.user_checkpoints(service, limit, offset)

    @app.delete("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}")
    def delete_checkpoint(run_id: str, kind: str, name: str):
        runs.delete(service, f"tinker://{run_id}/{kind}/{name}")
        return Response(status_code=200)

    @app.delete("/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}")
    def delete_checkpoint_by_bare_id(run_id: str, checkpoint_id: str):
        raise UserError(f"checkpoint id {checkpoint_id!r}: it is <weights|sampler_weights>/<name>, as "
                        "list_checkpoints gives it")

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request):
        path = (await read_json(request)).get("tinker_path")
        return await asyncio.to_thread(runs.weights_info, service, path)

    @app.get("/api/v1/sessions")
    def list_sessions(limit: int = 20, offset: int = 0, access_scope: str = "owned"):
        runs.check_scope(access_scope)
        return runs.sessions(service, limit, offset)

    @app.get("/api/v1/sessions/{session_id}")
    def get_session(session_id: str, access_scope: str = "owned"):
        runs.check_scope(access_scope)
        return runs.session(service, session_id)

    # -- futures -------------------------------------------------------------------
    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        req = await parse(request, types.FutureRetrieveRequest)
        fut = service.futures.get(req.request_id)
        if fut is None:
            return user_error(f"no request {req.request_id!r}: unknown, or its result was dropped (results are kept "
                              f"{service.keep_s:g} s after they finish, the service's --keep-s, and at most "
                              f"{min(RETRIEVED_KEEP_S, service.keep_s):g} s after they are first retrieved)", 404)
        await asyncio.wait([asyncio.wrap_future(fut)], timeout=poll_s)
        if not fut.done():
            return JSONResponse({"type": "try_again", "request_id": req.request_id, "queue_state": "active"},
                                status_code=408)
        body = fut.result()
        service.retrieved(req.request_id)
        if isinstance(body, bytes):
            return Response(body, media_type=PROTO)
        return body

    @app.post("/api/v1/cancel_future")
    async def cancel_future():
        return Response(status_code=200)  # requests run to the end; the result is simply not fetched

    return app
