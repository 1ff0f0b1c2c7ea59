"""The Tinker service's state: sessions, training models and their request order, sampling
sessions, futures and checkpoints, over one Trainer and one Sampler (no HTTP here: serve/app.py
is the HTTP layer).

Requests that touch a model (forward, forward_backward, optim_step, save_*, load) carry the
model's `seq_id` (the SDK numbers them 1, 2, ...; the chunks of one forward_backward take
consecutive ids and arrive in parallel). A request is held until every lower id of its model has
been queued, then queued itself, so a model's requests run in `seq_id` order whatever order they
arrive in; a request whose (model, seq_id) was seen before gets the first one's future back, so a
retried request is not applied twice. A missing seq_id is waited for at most `seq_wait_s`: then
the requests held behind it fail with an error naming it, and the model goes on from the next id.
Every model and sampling call runs on one worker thread, in queue order.

A session ends at `sessions/{id}/finish` or when neither a heartbeat nor a request of its models
has come for `session_timeout_s`; its training clients' adapters and optimizer state and its
sampling sessions' weights are then freed (after the requests already queued), and later calls
on them are refused, so a long-running service does not accumulate dead clients.

A finished request's result is kept `keep_s` after it finishes, and at most `RETRIEVED_KEEP_S`
after it is first retrieved (the SDK polls once it has a result only when a poll's answer was
lost); then it is dropped, with its retry keys, so a week-long service does not hold every
result it ever gave. A sampling session unused for `session_timeout_s` (the RL loop makes one a
step from the current weights) is freed with its weights; a later call on it is refused.

A future's result is the response body: protobuf bytes (forward_backward, sample) or a JSON
object; a failure is the API's error body {"error", "category"} ("user" for the caller's
mistakes, "server" otherwise), and the service goes on.

Checkpoints live under `<logdir>/checkpoints/<model id>/<weights|sampler_weights>/<name>/` and
their `tinker://<model id>/<kind>/<name>` paths map to those directories, so a checkpoint
written before a restart loads after it; serve/store.py records the runs created and every save
and deletion in the logdir.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from serve.store import NAME, Store
from serve.trainer import LoraChoice, UserError

log = logging.getLogger("tandem.tinker")

RETRIEVED_KEEP_S = 60.0
"""How long a result stays after its first retrieval, for a client whose poll's answer was lost."""


def sampler_device(actor) -> str:
    """Where the sampling engines run: a GPU where this process sees one (unless --actor.device cpu)."""
    import torch

    return "cuda" if actor.device != "cpu" and torch.cuda.is_available() else "cpu"


class Result(Future):
    """A request's future that knows when its result was set (`Service` drops it `keep_s` later)."""

    finished_at: float | None = None

    def set_result(self, result) -> None:
        self.finished_at = time.time()  # before waiters wake: a result seen is always stamped
        super().set_result(result)


@dataclass
class Model:
    model_id: str
    adapter: str
    """Its adapter's name in the Trainer."""
    lora: LoraChoice
    next_seq: int = 1
    held: dict[int, Callable] = field(default_factory=dict)
    """Requests waiting for a lower seq_id, by seq_id."""
    seen: dict[int, str] = field(default_factory=dict)
    """seq_id -> request id, of every request accepted."""
    blocked_since: float | None = None
    """When a request began waiting for the missing `next_seq` (None: nothing held)."""

    @property
    def session(self) -> str:
        return self.model_id.rsplit(":train:", 1)[0]


@dataclass
class SamplingSession:
    sampler_id: str
    model_path: str | None
    weights: Any
    """serve.sampler.Weights."""
    seen: dict[int, str] = field(default_factory=dict)
    last_used: float = field(default_factory=time.time)


class Service:
    """Everything the API's endpoints do, callable in-process (tests, benchmarks).

    Usage::

        service = Service(model_dir, "builtin:tiny", logdir)
        session = service.create_session()
        rid = service.submit(service.create_model_job(session, 0, LoraChoice(rank=8)))
        body = service.futures[rid].result()
        service.close()
    """

    def __init__(self, model_path: str, model_name: str, logdir: Path, threads: int = 0,
                 session_timeout_s: float = 600.0, seq_wait_s: float = 300.0, keep_s: float = 600.0,
                 ranks=None, actor=None) -> None:
        from serve.sampler import Sampler
        from serve.trainer import Trainer

        self.model_path, self.model_name = model_path, model_name
        self.logdir = Path(logdir)
        self.store = Store(self.logdir)
        self.trainer = Trainer(model_path, threads, ranks=ranks)  # ranks: serve/ranks.py, --learners above 1
        self.sampler = Sampler(model_path) if actor is None else Sampler(  # actor: the --actor section
            model_path, actor.engine, actor.engine_options(), sampler_device(actor))
        self.sessions: dict[str, dict] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, SamplingSession] = {}
        self.futures: dict[str, Result] = {}
        self._retrieved: dict[str, float] = {}  # request id -> when it was first retrieved
        self._adapters = itertools.count()  # the Trainer's adapter names: m0, m1, ...
        self._keys: dict[tuple, str] = {}  # (kind, ids...) -> request id: creation requests seen
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="tinker-worker", daemon=True)
        self._worker.start()
        if session_timeout_s <= 0 or seq_wait_s <= 0 or keep_s <= 0:
            raise ValueError("session_timeout_s, seq_wait_s and keep_s must be positive")
        self.session_timeout_s, self.seq_wait_s, self.keep_s = session_timeout_s, seq_wait_s, keep_s
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="tinker-reaper", daemon=True)
        self._reaper.start()

    # -- names -------------------------------------------------------------------
    def names(self) -> set[str]:
        """The base-model names this service answers to: its --model and the local directory."""
        return {self.model_name, self.model_path}

    def check_base(self, base_model: str | None) -> None:
        if base_model is not None and base_model not in self.names():
            raise UserError(f"base_model {base_model!r} is not served here; this service serves "
                            f"{self.model_path!r} (also called {self.model_name!r})")

    # -- the worker ----------------------------------------------------------------
    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, job = item
            try:
                future.set_result(job())
            except UserError as exc:
                future.set_result({"error": str(exc), "category": "user"})
            except Exception as exc:  # noqa: BLE001 - answered as the request's failure; the service goes on
                log.exception("request failed")
                future.set_result({"error": f"{type(exc).__name__}: {exc}", "category": "server"})

    def _new_future(self) -> tuple[str, Result]:
        rid = uuid.uuid4().hex
        future = Result()
        self.futures[rid] = future
        return rid, future

    def retrieved(self, rid: str) -> None:
        """The result of `rid` has been handed to a client: it is kept `RETRIEVED_KEEP_S` more."""
        with self._lock:
            if rid in self.futures:  # not dropped meanwhile
                self._retrieved.setdefault(rid, time.time())

    def _drop_results(self, now: float) -> None:
        """Drop the results kept long enough (module docstring), and every key that names them. Under the lock."""
        after_retrieval = min(RETRIEVED_KEEP_S, self.keep_s)
        old = {rid for rid, f in self.futures.items() if f.finished_at is not None
               and (now - f.finished_at > self.keep_s or now - self._retrieved.get(rid, math.inf) > after_retrieval)}
        if not old:
            return
        for rid in old:
            del self.futures[rid]
            self._retrieved.pop(rid, None)
        self._keys = {k: rid for k, rid in self._keys.items() if rid not in old}
        for owner in [*self.models.values(), *self.samplers.values()]:
            owner.seen = {seq: rid for seq, rid in owner.seen.items() if rid not in old}

    def sampling(self, sampler_id: str) -> SamplingSession:
        """The sampling session, marked used now; refused when unknown or freed."""
        s = self.samplers.get(sampler_id)
        if s is None:
            raise UserError(f"no sampling session {sampler_id!r}: unknown, or its session finished, or unused for "
                            f"{self.session_timeout_s:g} s (the service's --session-timeout-s) and freed")
        s.last_used = time.time()
        return s

    def submit(self, job: Callable, key: tuple | None = None) -> str:
        """Queue `job`; its request id. A `key` seen before returns that request's id instead."""
        with self._lock:
            if key is not None and key in self._keys:
                return self._keys[key]
            rid, future = self._new_future()
            if key is not None:
                self._keys[key] = rid
            self._queue.put((future, job))
            return rid

    def done(self, body: Any) -> str:
        """A request answered at once (an error found before queueing): its id."""
        with self._lock:
            rid, future = self._new_future()
        future.set_result(body)
        return rid

    def submit_ordered(self, model_id: str, seq_id: int, job: Callable) -> str:
        """Queue `job` as request `seq_id` of `model_id`, after every lower one; the request id."""
        with self._lock:
            model = self.model(model_id)
            self.sessions[model.session]["heartbeat"] = time.time()  # a client at work is alive
            self.store.touch(model_id)
            if seq_id in model.seen:
                return model.seen[seq_id]
            if seq_id < model.next_seq:
                raise UserError(f"seq_id {seq_id} of {model_id} is below its next one, {model.next_seq}")
            rid, future = self._new_future()
            model.seen[seq_id] = rid
            model.held[seq_id] = (future, job)
            self._release(model)
            return rid

    def _release(self, model: Model) -> None:
        """Queue the model's held requests from `next_seq` on, as far as they are consecutive."""
        advanced = False
        while model.next_seq in model.held:
            self._queue.put(model.held.pop(model.next_seq))
            model.next_seq += 1
            advanced = True
        if not model.held:
            model.blocked_since = None
        elif advanced or model.blocked_since is None:  # a new gap: its wait starts now
            model.blocked_since = time.time()

    def _skip_gap(self, model: Model, now: float) -> None:
        """Fail the requests held behind the missing `next_seq` (the SDK's error form, naming it);
        the model goes on from the id after the last of them. Under the lock."""
        missing = model.next_seq
        waited = now - (model.blocked_since or now)
        held = sorted(model.held)
        message = (f"seq_id {missing} of model {model.model_id} never arrived (waited {waited:.0f} s, the "
                   f"service's --seq-wait-s is {self.seq_wait_s:g}); requests {held} after it are refused")
        log.warning(message)
        for seq in held:
            future, _ = model.held.pop(seq)
            future.set_result({"error": message, "category": "user"})
        model.next_seq, model.blocked_since = held[-1] + 1, None

    # -- sessions ----------------------------------------------------------------
    def create_session(self, metadata: dict | None = None, display_name: str | None = None) -> str:
        sid = f"session-{uuid.uuid4().hex[:16]}"
        self.sessions[sid] = {"created": time.time(), "heartbeat": time.time(), "finished": None,
                              "metadata": metadata or {}, "display_name": display_name}
        self.store.add_session(sid, self.sessions[sid]["created"], metadata, display_name)
        return sid

    def session(self, sid: str) -> dict:
        s = self.sessions.get(sid)
        if s is None:
            raise UserError(f"no session {sid!r} on this service")
        return s

    def live(self, sid: str) -> dict:
        """The session, refused (UserError) once it has finished."""
        s = self.session(sid)
        if s["finished"] is not None:
            raise UserError(f"session {sid} has finished ({s['finished']}); start a new ServiceClient")
        return s

    def finish_session(self, sid: str, reason: str) -> None:
        """End the session (the first reason stays) and free its clients once the requests
        already queued have run."""
        with self._lock:
            s = self.session(sid)
            if s["finished"] is not None:
                return
            s["finished"] = reason
            self.store.finish_session(sid, reason)
            self._queue.put((Future(), lambda: self._free(sid)))

    def _free(self, sid: str) -> dict:
        """(worker) Drop the finished session's training clients, held requests and sampling sessions."""
        reason = f"its session {sid} has finished ({self.sessions[sid]['finished']})"
        with self._lock:
            models = [self.models.pop(k) for k in list(self.models) if self.models[k].session == sid]
            for m in models:
                for seq in sorted(m.held):
                    m.held.pop(seq)[0].set_result({"error": f"model {m.model_id}: {reason}", "category": "user"})
            for k in [k for k in self.samplers if k.rsplit(":sample:", 1)[0] == sid]:
                del self.samplers[k]
        for m in models:
            self.trainer.delete(m.adapter)
        if models:
            log.info("freed %d training client(s): %s", len(models), reason)
        return {"freed": [m.model_id for m in models]}

    def reap(self, now: float | None = None) -> None:
        """Finish the sessions silent for `session_timeout_s`, free the sampling sessions unused as
        long, drop the results kept long enough, and fail the requests waiting longer than
        `seq_wait_s` for a missing seq_id (run every few seconds by the reaper thread)."""
        now = time.time() if now is None else now
        with self._lock:
            self._drop_results(now)
            idle = [k for k, s in self.samplers.items() if now - s.last_used > self.session_timeout_s]
            for k in idle:
                del self.samplers[k]
            if idle:
                log.info("freed %d sampling session(s) unused for %.0f s", len(idle), self.session_timeout_s)
            for m in self.models.values():
                if m.held and m.blocked_since is not None and now - m.blocked_since > self.seq_wait_s:
                    self._skip_gap(m, now)
            silent = [sid for sid, s in self.sessions.items()
                      if s["finished"] is None and now - s["heartbeat"] > self.session_timeout_s]
        for sid in silent:
            log.warning("session %s sent nothing for %.0f s: finishing it", sid, self.session_timeout_s)
            self.finish_session(sid, "heartbeat timeout")

    def _reap_loop(self) -> None:
        period = min(5.0, self.seq_wait_s / 4, self.session_timeout_s / 4, self.keep_s / 4)
        while not self._stop.wait(period):
            try:
                self.reap()
                self.store.write_last_requests()
            except Exception:  # noqa: BLE001 - the reaper must outlive a bad state; it is logged
                log.exception("reaping failed")

    # -- models ------------------------------------------------------------------
    def create_model_job(self, sid: str, model_seq_id: int, lora: LoraChoice,
                         user_metadata: dict | None = None) -> Callable:
        model_id = f"{sid}:train:{model_seq_id}"
        adapter = f"m{next(self._adapters)}"

        def job():
            self.trainer.create(adapter, lora)
            self.store.add_run(model_id, self.model_path, lora.to_dict(), sid, user_metadata)
            with self._lock:
                self.models[model_id] = Model(model_id, adapter, lora)
            return {"model_id": model_id, "type": "create_model"}
        return job

    def model(self, model_id: str) -> Model:
        m = self.models.get(model_id)
        s = self.sessions.get(model_id.rsplit(":train:", 1)[0])
        if s is not None and s["finished"] is not None:
            raise UserError(f"model {model_id} was freed: its session has finished ({s['finished']})")
        if m is None:
            raise UserError(f"no model {model_id!r} on this service (a finished session's models are freed)")
        return m

    def info(self, model_id: str) -> dict:
        m = self.model(model_id)
        return {"type": "get_info", "model_id": model_id, "is_lora": True, "lora_rank": m.lora.rank,
                "model_name": self.model_path,
                "model_data": {"arch": self.trainer.base.config.model_type, "model_name": self.model_path,
                               "tokenizer_id": self.model_path}}

    # -- checkpoints -------------------------------------------------------------
    def save(self, model_id: str, name: str | None, kind: str, optimizer: bool) -> str:
        """Save the model's adapter (with its optimizer for kind "weights") as `name`; its path."""
        m = self.model(model_id)
        name = name or f"step-{self.trainer.steps[m.adapter]:06d}-{uuid.uuid4().hex[:6]}"
        if not NAME.fullmatch(name):
            raise UserError(f"checkpoint name {name!r}: use letters, digits and . _ : - (no /)")
        path = f"tinker://{model_id}/{kind}/{name}"
        self.trainer.save(m.adapter, self.store.place(path), optimizer=optimizer, base_model=self.model_path)
        self.store.record_save(path, self.trainer.steps[m.adapter])
        return path

    def load_into(self, model_id: str, path: str, optimizer: bool) -> None:
        self.trainer.load(self.model(model_id).adapter, self.store.find(path), optimizer)

    def create_model_from_state_job(self, sid: str, model_seq_id: int, path: str, optimizer: bool) -> Callable:
        model_id = f"{sid}:train:{model_seq_id}"
        adapter = f"m{next(self._adapters)}"

        def job():
            self.trainer.load(adapter, self.store.find(path), optimizer)
            self.store.add_run(model_id, self.model_path, self.trainer.choices[adapter].to_dict(), sid, None)
            with self._lock:
                self.models[model_id] = Model(model_id, adapter, self.trainer.choices[adapter])
            return {"type": "load_weights", "path": path, "model_id": model_id}
        return job

    # -- sampling ----------------------------------------------------------------
    def weights_of(self, path: str | None):
        """The sampler's Weights for a tinker:// path (either kind), or the base model for None."""
        from policy.adapter import read_adapter
        from serve.sampler import Weights

        if path is None:
            return Weights("base", None, None)
        adapter = read_adapter(self.store.find(path))
        return Weights(path, adapter.lora_spec(), adapter.tensors)

    def snapshot(self, model_id: str):
        """The model's current adapter as sampler Weights (a copy: later steps do not change it)."""
        from serve.sampler import Weights

        m = self.model(model_id)
        return Weights(f"snapshot-{uuid.uuid4().hex}", self.trainer.specs[m.adapter], self.trainer.tensors(m.adapter))

    def add_sampler(self, sampler_id: str, model_path: str | None, weights) -> str:
        self.samplers[sampler_id] = SamplingSession(sampler_id, model_path, weights)
        return sampler_id

    def close(self) -> None:
        self._stop.set()
        self.store.write_last_requests()
        self._queue.put(None)
        self._worker.join(timeout=60)
        if not self._worker.is_alive():  # the worker is the only caller of the trainer
            self.trainer.close()
        self.sampler.close()
