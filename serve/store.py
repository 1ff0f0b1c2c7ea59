"""The service's records in its logdir: the sessions and training runs it created, the checkpoints it
saved, and when each run's requests last came.

`<logdir>/sessions.jsonl` gets a line per session created (its id, user metadata, display name,
time) and one when it finishes (why, when); `<logdir>/training_runs.jsonl` a line per training
client created (its id, base model, LoRA config, session, user metadata, time);
`<logdir>/last_requests.json` maps each run to when a request of it last came, rewritten whole
(atomically) by the service every few seconds while requests come and at its end;
`<logdir>/checkpoints.jsonl` a line per save
(`{"path", "time", "step"}`) and per deletion (`{"path", "deleted"}`), the later line about a path
winning (a name saved again after its deletion is back). Both are read at start, so a restarted
service lists, describes and loads what an earlier one saved. A checkpoint is the directory
`<logdir>/checkpoints/<model id>/<weights|sampler_weights>/<name>/`; one whose directory is gone is
not listed. A deletion renames the directory aside (one atomic step) before removing it.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from serve.trainer import UserError

log = logging.getLogger("tandem.tinker")

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
"""A checkpoint name or a model id as it may appear in a tinker:// path (no "/", no "..")."""

KINDS = {"weights": "training", "sampler_weights": "sampler"}
"""A tinker:// path's kind -> the API's checkpoint_type."""

RUNS_FILE, CHECKPOINTS_FILE, SESSIONS_FILE = "training_runs.jsonl", "checkpoints.jsonl", "sessions.jsonl"
LAST_REQUESTS_FILE = "last_requests.json"


class NotFound(UserError):
    """The caller named a run, checkpoint or session this service does not have (answered 404)."""


def parse_path(path: str) -> tuple[str, str, str]:
    """(model id, kind, name) of `tinker://<model id>/<weights|sampler_weights>/<name>`;
    UserError for anything else."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise UserError(f"{path!r} is not a tinker:// path")
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not all(NAME.fullmatch(p) for p in (parts[0], parts[2])):
        raise UserError(f"{path!r} is not tinker://<model id>/<weights|sampler_weights>/<name>")
    return parts[0], parts[1], parts[2]


def when(t: float) -> str:
    """A time as the API writes it: ISO 8601 in UTC."""
    return datetime.fromtimestamp(t, timezone.utc).isoformat()


@dataclass
class Saved:
    path: str
    time: float
    step: int


def read_lines(file: Path, key: str) -> list[dict]:
    """The JSON objects of a .jsonl file that name a `key` (none if it is absent); a torn last line
    is skipped."""
    if not file.is_file():
        return []
    records = []
    for n, line in enumerate(file.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            log.warning("%s line %d is not JSON (a write cut short?): skipped", file, n)
            continue
        if isinstance(record, dict) and isinstance(record.get(key), str):
            records.append(record)
    return records


class Store:
    """The runs and checkpoints of one logdir (thread-safe: the worker saves while routes list).

    Usage::

        store = Store(logdir)
        store.add_run(model_id, base_model, lora.to_dict(), session_id, user_metadata)
        directory = store.place(path)   # write the checkpoint there, then
        store.record_save(path, step)
        store.find(path)                # its directory, or UserError saying why there is none
        store.delete(path)
    """

    def __init__(self, logdir: Path) -> None:
        self.logdir = Path(logdir)
        self.root = self.logdir / "checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._runs: dict[str, dict] = {r["training_run_id"]: r
                                       for r in read_lines(self.logdir / RUNS_FILE, "training_run_id")}
        self._sessions: dict[str, dict] = {}  # session id -> its record, finish merged in
        for record in read_lines(self.logdir / SESSIONS_FILE, "session_id"):
            self._sessions.setdefault(record["session_id"], {}).update(record)
        self._saved: dict[str, Saved] = {}  # path -> its latest save, in save order
        self._deleted: dict[str, float] = {}  # path -> when it was deleted
        self._last_request: dict[str, float] = self._read_last_requests()  # run id -> when a request came
        self._unwritten = False  # a request came since last_requests.json was written
        for record in read_lines(self.logdir / CHECKPOINTS_FILE, "path"):
            self._apply(record)

    def _read_last_requests(self) -> dict[str, float]:
        file = self.logdir / LAST_REQUESTS_FILE
        try:
            times = json.loads(file.read_text()) if file.is_file() else {}
        except ValueError:
            log.warning("%s is not JSON: the runs' last request times start from their saves", file)
            return {}
        return {k: float(v) for k, v in times.items() if isinstance(k, str) and isinstance(v, (int, float))} \
            if isinstance(times, dict) else {}

    def _apply(self, record: dict) -> None:
        path = record["path"]
        self._saved.pop(path, None)
        if "deleted" in record:
            self._deleted[path] = float(record["deleted"])
        else:
            self._deleted.pop(path, None)
            self._saved[path] = Saved(path, float(record.get("time", 0.0)), int(record.get("step", 0)))

    def _append(self, name: str, record: dict) -> None:
        with open(self.logdir / name, "a") as f:
            f.write(json.dumps(record) + "\n")

    # -- training runs -----------------------------------------------------------
    def add_run(self, run_id: str, base_model: str, lora: dict, session: str, user_metadata: dict | None) -> None:
        record = {"training_run_id": run_id, "base_model": base_model, "lora": lora, "session": session,
                  "user_metadata": user_metadata, "created": time.time()}
        with self._lock:
            self._append(RUNS_FILE, record)
            self._runs[run_id] = record
            self._last_request[run_id] = record["created"]

    def touch(self, run_id: str) -> None:
        """A request of the run came now (on disk at the next `write_last_requests`)."""
        self._last_request[run_id] = time.time()
        self._unwritten = True

    def write_last_requests(self) -> None:
        """Rewrite last_requests.json if a request came since it was written (a new file renamed
        over the old one: a reader never sees half of it)."""
        if not self._unwritten:
            return
        self._unwritten = False
        file = self.logdir / LAST_REQUESTS_FILE
        tmp = file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(dict(self._last_request)))
        tmp.replace(file)

    # -- sessions ---------------------------------------------------------------
    def add_session(self, session_id: str, created: float, metadata: dict | None, display_name: str | None) -> None:
        record = {"session_id": session_id, "created": created, "metadata": metadata or {},
                  "display_name": display_name}
        with self._lock:
            self._append(SESSIONS_FILE, record)
            self._sessions[session_id] = dict(record)

    def finish_session(self, session_id: str, reason: str) -> None:
        record = {"session_id": session_id, "finished": reason, "finished_at": time.time()}
        with self._lock:
            self._append(SESSIONS_FILE, record)
            self._sessions.setdefault(session_id, {}).update(record)

    def session(self, session_id: str) -> dict | None:
        """The recorded session (created, metadata, display_name, finished), or None."""
        with self._lock:
            record = self._sessions.get(session_id)
            return dict(record) if record is not None else None

    def session_ids(self) -> list[str]:
        """Every session recorded, oldest first."""
        with self._lock:
            return sorted(self._sessions, key=lambda sid: self._sessions[sid].get("created", 0.0))

    def last_request(self, run_id: str) -> float:
        """When a request of the run last came (kept across restarts in last_requests.json), else
        its latest save or creation."""
        if run_id in self._last_request:
            return self._last_request[run_id]
        saves = [s.time for s in self.checkpoints(run_id)]
        return max([self.run(run_id)["created"], *saves])

    def run_ids(self) -> list[str]:
        """Every run this logdir knows, oldest first: those created, and those known only by their
        checkpoints (saved before runs were recorded)."""
        with self._lock:
            ids = dict.fromkeys(self._runs)
            ids.update(dict.fromkeys(parse_path(p)[0] for p in self._saved))
        return list(ids)

    def run(self, run_id: str) -> dict:
        """The run's record; NotFound for an id this logdir never saw."""
        with self._lock:
            record = self._runs.get(run_id)
        if record is not None:
            return record
        first = next(iter(self.checkpoints(run_id)), None)
        if first is None:
            raise NotFound(f"no training run {run_id!r} on this service (its runs are recorded in {self.logdir})")
        info = self.weights_info(first.path)
        return {"training_run_id": run_id, "base_model": info["base_model"], "lora": info["lora"],
                "session": run_id.rsplit(":train:", 1)[0], "user_metadata": None, "created": first.time}

    # -- checkpoints -------------------------------------------------------------
    def place(self, path: str) -> Path:
        """The directory a checkpoint of `path` is written to (not checked for existence)."""
        model_id, kind, name = parse_path(path)
        return self.root / model_id / kind / name

    def find(self, path: str) -> Path:
        """The directory of the saved checkpoint `path`; UserError saying why there is none."""
        directory = self.place(path)
        with self._lock:
            deleted = self._deleted.get(path)
        if deleted is not None:
            raise NotFound(f"checkpoint {path} was deleted ({when(deleted)})")
        if not (directory / "tinker.json").is_file():
            raise NotFound(f"no checkpoint at {path} on this service (its checkpoints are under {self.root})")
        return directory

    def record_save(self, path: str, step: int) -> None:
        record = {"path": path, "time": time.time(), "step": step}
        with self._lock:
            self._append(CHECKPOINTS_FILE, record)
            self._apply(record)

    def checkpoints(self, run_id: str | None = None) -> list[Saved]:
        """The checkpoints on disk, of one run or all, in save order."""
        with self._lock:
            saved = list(self._saved.values())
        return [s for s in saved if (run_id is None or parse_path(s.path)[0] == run_id)
                and (self.place(s.path) / "tinker.json").is_file()]

    def size(self, path: str) -> int:
        """The bytes of a checkpoint's files (0 once it is gone)."""
        total = 0
        for f in self.place(path).rglob("*"):
            try:
                total += f.stat().st_size if f.is_file() else 0
            except FileNotFoundError:  # deleted while counted
                pass
        return total

    def weights_info(self, path: str) -> dict:
        """How the checkpoint was made: base model and LoRA config, from its files."""
        from policy.adapter import CONFIG_FILE

        directory = self.find(path)
        meta = json.loads((directory / "tinker.json").read_text())
        config = json.loads((directory / CONFIG_FILE).read_text())
        return {"base_model": config.get("base_model_name_or_path") or "", "lora": meta["lora"],
                "step": meta.get("step", 0), "optimizer": bool(meta.get("optimizer"))}

    def delete(self, path: str) -> None:
        """Remove the checkpoint and record its deletion; NotFound when there is none to delete."""
        directory = self.place(path)
        with self._lock:
            if path in self._deleted:
                raise NotFound(f"checkpoint {path} was already deleted ({when(self._deleted[path])})")
            if not (directory / "tinker.json").is_file():
                raise NotFound(f"no checkpoint at {path} on this service (its checkpoints are under {self.root})")
            aside = directory.with_name(f".{directory.name}.deleted-{uuid.uuid4().hex[:8]}")
            directory.rename(aside)  # a load from now on finds nothing there
            record = {"path": path, "deleted": time.time()}
            self._append(CHECKPOINTS_FILE, record)
            self._apply(record)
        shutil.rmtree(aside, ignore_errors=True)
        log.info("deleted checkpoint %s", path)
