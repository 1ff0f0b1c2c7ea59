"""The Tinker service's state: sessions, training models and their request order, sampling
sessions, futures and checkpoints, over one Trainer and one Sampler (no HTTP here: serve/app.py
is the HTTP layer).

Requests that touch a model (forward, forward_backward, optim_step, save_*, load) carry the
model's `seq_id` (the SDK numbers them 1, 2, ...; the chunks of one forward_backward take
consecutive ids and arrive in parallel). A request is held until every lower id of its model has
been queued, then queued itself, so a model's requests run in `seq_id` order whatever order they
arrive in; a request whose (model, seq_id) was seen before gets the first one's future back, so a
retried request is not applied twice. Every model and sampling call runs on one worker thread,
in queue order.

A future's result is the response body: protobuf bytes (forward_backward, sample) or a JSON
object; a failure is the API's error body {"error", "category"} ("user" for the caller's
mistakes, "server" otherwise), and the service goes on.

Checkpoints live under `<logdir>/checkpoints/<model id>/<weights|sampler_weights>/<name>/` and
their `tinker://<model id>/<kind>/<name>` paths map to those directories, so a checkpoint
written before a restart loads after it; `<logdir>/checkpoints.jsonl` lists every save.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import re
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from serve.trainer import LoraChoice, UserError

log = logging.getLogger("tandem.tinker")

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
"""A checkpoint name or a model id as it may appear in a tinker:// path (no "/", no "..")."""

KINDS = {"weights": "training", "sampler_weights": "sampler"}


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


@dataclass
class SamplingSession:
    sampler_id: str
    model_path: str | None
    weights: Any
    """serve.sampler.Weights."""
    seen: dict[int, str] = field(default_factory=dict)


def parse_path(path: str) -> tuple[str, str, str]:
    """(model id, kind, name) of `tinker://<model id>/<weights|sampler_weights>/<name>`;
    UserError for anything else."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise UserError(f"{path!r} is not a tinker:// path")
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not all(NAME.fullmatch(p) for p in (parts[0], parts[2])):
        raise UserError(f"{path!r} is not tinker://<model id>/<weights|sampler_weights>/<name>")
    return parts[0], parts[1], parts[2]


class Service:
    """Everything the API's endpoints do, callable in-process (tests, benchmarks).

    Usage::

        service = Service(model_dir, "builtin:tiny", logdir)
        session = service.create_session()
        rid = service.submit(service.create_model_job(session, 0, LoraChoice(rank=8)))
        body = service.futures[rid].result()
        service.close()
    """

    def __init__(self, model_path: str, model_name: str, logdir: Path, threads: int = 0) -> None:
        from serve.sampler import Sampler
        from serve.trainer import Trainer

        self.model_path, self.model_name = model_path, model_name
        self.logdir = Path(logdir)
        (self.logdir / "checkpoints").mkdir(parents=True, exist_ok=True)
        self.trainer = Trainer(model_path, threads)
        self.sampler = Sampler(model_path)
        self.sessions: dict[str, dict] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, SamplingSession] = {}
        self.futures: dict[str, Future] = {}
        self._adapters = itertools.count()  # the Trainer's adapter names: m0, m1, ...
        self._keys: dict[tuple, str] = {}  # (kind, ids...) -> request id: creation requests seen
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="tinker-worker", daemon=True)
        self._worker.start()

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

    def _new_future(self) -> tuple[str, Future]:
        rid = uuid.uuid4().hex
        future: Future = Future()
        self.futures[rid] = future
        return rid, future

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
            model = self.models.get(model_id)
            if model is None:
                raise UserError(f"no model {model_id!r} on this service")
            if seq_id in model.seen:
                return model.seen[seq_id]
            if seq_id < model.next_seq:
                raise UserError(f"seq_id {seq_id} of {model_id} is below its next one, {model.next_seq}")
            rid, future = self._new_future()
            model.seen[seq_id] = rid
            model.held[seq_id] = (future, job)
            while model.next_seq in model.held:
                self._queue.put(model.held.pop(model.next_seq))
                model.next_seq += 1
            return rid

    # -- sessions ----------------------------------------------------------------
    def create_session(self, metadata: dict | None = None) -> str:
        sid = f"session-{uuid.uuid4().hex[:16]}"
        self.sessions[sid] = {"created": time.time(), "heartbeat": time.time(), "finished": None,
                              "metadata": metadata or {}}
        return sid

    def session(self, sid: str) -> dict:
        s = self.sessions.get(sid)
        if s is None:
            raise UserError(f"no session {sid!r} on this service")
        return s

    # -- models ------------------------------------------------------------------
    def create_model_job(self, sid: str, model_seq_id: int, lora: LoraChoice) -> Callable:
        model_id = f"{sid}:train:{model_seq_id}"
        adapter = f"m{next(self._adapters)}"

        def job():
            self.trainer.create(adapter, lora)
            self.models[model_id] = Model(model_id, adapter, lora)
            return {"model_id": model_id, "type": "create_model"}
        return job

    def model(self, model_id: str) -> Model:
        m = self.models.get(model_id)
        if m is None:
            raise UserError(f"no model {model_id!r} on this service")
        return m

    def info(self, model_id: str) -> dict:
        m = self.model(model_id)
        return {"type": "get_info", "model_id": model_id, "is_lora": True, "lora_rank": m.lora.rank,
                "model_name": self.model_path,
                "model_data": {"arch": self.trainer.base.config.model_type, "model_name": self.model_path,
                               "tokenizer_id": self.model_path}}

    # -- checkpoints -------------------------------------------------------------
    def checkpoint_dir(self, path: str) -> Path:
        model_id, kind, name = parse_path(path)
        return self.logdir / "checkpoints" / model_id / kind / name

    def save(self, model_id: str, name: str | None, kind: str, optimizer: bool) -> str:
        """Save the model's adapter (with its optimizer for kind "weights") as `name`; its path."""
        m = self.model(model_id)
        name = name or f"step-{self.trainer.steps[m.adapter]:06d}-{uuid.uuid4().hex[:6]}"
        if not NAME.fullmatch(name):
            raise UserError(f"checkpoint name {name!r}: use letters, digits and . _ : - (no /)")
        path = f"tinker://{model_id}/{kind}/{name}"
        directory = self.checkpoint_dir(path)
        self.trainer.save(m.adapter, directory, optimizer=optimizer, base_model=self.model_path)
        with open(self.logdir / "checkpoints.jsonl", "a") as f:
            f.write(json.dumps({"path": path, "time": time.time(), "step": self.trainer.steps[m.adapter]}) + "\n")
        return path

    def load_into(self, model_id: str, path: str, optimizer: bool) -> None:
        directory = self.checkpoint_dir(path)
        if not (directory / "tinker.json").is_file():
            raise UserError(f"no checkpoint at {path}")
        self.trainer.load(self.model(model_id).adapter, directory, optimizer)

    def create_model_from_state_job(self, sid: str, model_seq_id: int, path: str, optimizer: bool) -> Callable:
        model_id = f"{sid}:train:{model_seq_id}"
        adapter = f"m{next(self._adapters)}"

        def job():
            directory = self.checkpoint_dir(path)
            if not (directory / "tinker.json").is_file():
                raise UserError(f"no checkpoint at {path}")
            self.trainer.load(adapter, directory, optimizer)
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
        directory = self.checkpoint_dir(path)
        if not (directory / "tinker.json").is_file():
            raise UserError(f"no checkpoint at {path}")
        adapter = read_adapter(directory)
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
        self._queue.put(None)
        self._worker.join(timeout=60)
        self.sampler.close()
