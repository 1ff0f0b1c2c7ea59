"""The Tinker API's listings of what a service has made: training runs, their checkpoints and the
sessions, in the bodies the SDK's RestClient reads (tinker 0.38.0's `TrainingRun`,
`TrainingRunsResponse`, `CheckpointsListResponse`, `WeightsInfoResponse`, `ListSessionsResponse`,
`GetSessionResponse`).

A training run is a training client the service created (serve/store.py keeps its record, so runs
and checkpoints outlive a restart); its `model_owner` is the session that created it, and it is
always LoRA. A checkpoint's `checkpoint_id` is `<weights|sampler_weights>/<name>`, as the SDK's
`ParsedCheckpointTinkerPath` writes it, so `delete_checkpoint(run, checkpoint_id)` takes what
`list_checkpoints` gives. The sessions are this process's and those named by a recorded run (an
earlier process's, known by their runs only). Every list is newest first.
"""

from __future__ import annotations

from serve.service import Service
from serve.store import KINDS, NotFound, Saved, Store, parse_path, when
from serve.trainer import UserError


def page(items: list, limit: int, offset: int) -> tuple[list, dict]:
    """The items of one page, and the API's cursor for it."""
    if limit < 0 or offset < 0:
        raise UserError(f"limit and offset must be at least 0; got limit={limit}, offset={offset}")
    return items[offset:offset + limit], {"offset": offset, "limit": limit, "total_count": len(items)}


def check_scope(access_scope: str, project_id: str | None = None) -> None:
    if access_scope not in ("owned", "accessible"):
        raise UserError(f"access_scope {access_scope!r}: use 'owned' or 'accessible'")
    if project_id is not None:
        raise UserError(f"project_id {project_id!r}: projects are not served by Tandem (every run of this "
                        "service belongs to the holder of its API key)")


def metadata(values: dict | None) -> dict[str, str] | None:
    return None if values is None else {str(k): v if isinstance(v, str) else str(v) for k, v in values.items()}


def session_of(run_id: str) -> str:
    return run_id.rsplit(":train:", 1)[0]


def checkpoint(store: Store, saved: Saved) -> dict:
    """A `types.Checkpoint`."""
    _, kind, name = parse_path(saved.path)
    return {"checkpoint_id": f"{kind}/{name}", "checkpoint_type": KINDS[kind], "time": when(saved.time),
            "tinker_path": saved.path, "size_bytes": store.size(saved.path), "public": False}


def training_run(service: Service, run_id: str) -> dict:
    """A `types.TrainingRun`; NotFound for a run this service never made."""
    store = service.store
    run = store.run(run_id)
    saves = store.checkpoints(run_id)
    last = {kind: next((s for s in reversed(saves) if parse_path(s.path)[1] == kind), None) for kind in KINDS}
    return {"training_run_id": run_id, "base_model": run["base_model"], "model_owner": run["session"],
            "is_lora": True, "corrupted": False, "lora_rank": run["lora"]["rank"],
            "last_request_time": when(store.last_request(run_id)),
            "last_checkpoint": last["weights"] and checkpoint(store, last["weights"]),
            "last_sampler_checkpoint": last["sampler_weights"] and checkpoint(store, last["sampler_weights"]),
            "user_metadata": metadata(run["user_metadata"])}


def training_runs(service: Service, limit: int, offset: int) -> dict:
    """A `types.TrainingRunsResponse`: one page of the runs, newest first."""
    ids, cursor = page(service.store.run_ids()[::-1], limit, offset)
    return {"training_runs": [training_run(service, i) for i in ids], "cursor": cursor}


def checkpoints(service: Service, run_id: str) -> dict:
    """A `types.CheckpointsListResponse` of one run (unpaged, as the SDK asks)."""
    service.store.run(run_id)
    return {"checkpoints": [checkpoint(service.store, s) for s in service.store.checkpoints(run_id)[::-1]]}


def user_checkpoints(service: Service, limit: int, offset: int) -> dict:
    """A `types.CheckpointsListResponse`: one page of every run's checkpoints, newest first."""
    saves, cursor = page(service.store.checkpoints()[::-1], limit, offset)
    return {"checkpoints": [checkpoint(service.store, s) for s in saves], "cursor": cursor}


def weights_info(service: Service, path: str) -> dict:
    """A `types.WeightsInfoResponse`: how the checkpoint at `path` was made."""
    info = service.store.weights_info(path)
    lora = info["lora"]
    return {"base_model": info["base_model"], "is_lora": True, "lora_rank": lora["rank"],
            "train_unembed": lora["train_unembed"], "train_mlp": lora["train_mlp"], "train_attn": lora["train_attn"]}


def session_ids(service: Service) -> list[str]:
    """Every session recorded in the logdir (this process's and earlier ones'), and those named
    only by a recorded run (an older logdir's), oldest first."""
    recorded = service.store.session_ids()
    return list(dict.fromkeys([*(session_of(r) for r in service.store.run_ids() if session_of(r) not in recorded),
                               *recorded]))


def sessions(service: Service, limit: int, offset: int) -> dict:
    """A `types.ListSessionsResponse`: one page of session ids, newest first."""
    return {"sessions": page(session_ids(service)[::-1], limit, offset)[0]}


def session(service: Service, session_id: str) -> dict:
    """A `types.GetSessionResponse`: the session's training runs and its live sampling sessions."""
    runs = [r for r in service.store.run_ids() if session_of(r) == session_id]
    known = service.store.session(session_id)
    if known is None and not runs:
        raise NotFound(f"no session {session_id!r} on this service")
    samplers = [k for k in list(service.samplers) if k.rsplit(":sample:", 1)[0] == session_id]
    return {"training_run_ids": runs, "sampler_ids": samplers,
            "user_metadata": metadata(known["metadata"]) if known else None,
            "display_name": known.get("display_name") if known else None}


def delete(service: Service, path: str) -> None:
    """Remove the checkpoint at `path` (its directory and its listing); NotFound when there is none."""
    service.store.delete(path)
