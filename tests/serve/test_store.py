"""serve/store.py in process: the logdir's records replayed at start (saves, deletions, a name saved
again, a torn last line, sessions and when each run's requests last came), runs known only by their
checkpoints, and why a path does not load."""

import json

import pytest

from serve.store import NotFound, Store
from serve.trainer import UserError

LORA = {"rank": 4, "seed": None, "train_mlp": True, "train_attn": False, "train_unembed": True}


def write_checkpoint(store: Store, path: str) -> None:
    """The files a save leaves that the store reads (the adapter's tensors are not read here)."""
    directory = store.place(path)
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/models/tiny"}))
    (directory / "tinker.json").write_text(json.dumps({"lora": LORA, "step": 3, "optimizer": True}))


def test_records_replay_after_a_restart(tmp_path):
    store = Store(tmp_path)
    store.add_run("s-1:train:0", "/models/tiny", LORA, "s-1", {"k": "v"})
    a, b = "tinker://s-1:train:0/weights/a", "tinker://s-1:train:0/sampler_weights/b"
    for path in (a, b):
        write_checkpoint(store, path)
        store.record_save(path, 3)
    store.delete(a)
    with pytest.raises(NotFound, match="was deleted"):
        store.find(a)
    write_checkpoint(store, a)  # the name saved again after its deletion
    store.record_save(a, 4)
    store.delete(b)
    with open(tmp_path / "checkpoints.jsonl", "a") as f:
        f.write('{"path": "tinker://s-1:tra')  # a write cut short by a crash
    again = Store(tmp_path)
    assert [s.path for s in again.checkpoints()] == [a] and again.checkpoints()[0].step == 4
    assert again.find(a) == store.place(a)
    with pytest.raises(NotFound, match="was deleted"):
        again.find(b)
    with pytest.raises(NotFound, match="already deleted"):
        again.delete(b)
    assert again.run("s-1:train:0")["user_metadata"] == {"k": "v"}
    assert again.size(a) > 0 and again.last_request("s-1:train:0") >= again.run("s-1:train:0")["created"]


def test_a_run_known_only_by_its_checkpoints(tmp_path):
    store = Store(tmp_path)
    path = "tinker://s-2:train:1/weights/final"
    write_checkpoint(store, path)
    (tmp_path / "checkpoints.jsonl").write_text(json.dumps({"path": path, "time": 5.0, "step": 3}) + "\n")
    old = Store(tmp_path)  # a logdir written before training runs were recorded
    assert old.run_ids() == ["s-2:train:1"]
    run = old.run("s-2:train:1")
    assert (run["base_model"], run["lora"], run["session"], run["created"]) == ("/models/tiny", LORA, "s-2", 5.0)
    with pytest.raises(NotFound, match="no training run"):
        old.run("s-3:train:0")


def test_paths_that_do_not_load(tmp_path):
    store = Store(tmp_path)
    with pytest.raises(NotFound, match="no checkpoint at"):
        store.find("tinker://elsewhere:train:0/weights/x")
    for bad in ("tinker://../weights/x", "tinker://a/b/c/d", "file:///etc/passwd", "tinker://a/other/x"):
        with pytest.raises(UserError, match="tinker://"):
            store.find(bad)


def test_sessions_and_last_requests_replay_after_a_restart(tmp_path):
    store = Store(tmp_path)
    store.add_session("s-1", 10.0, {"who": "me"}, "first")
    store.add_session("s-2", 20.0, None, None)
    store.finish_session("s-1", "success")
    store.add_run("s-1:train:0", "/models/tiny", LORA, "s-1", None)
    store.touch("s-1:train:0")
    touched = store.last_request("s-1:train:0")
    store.write_last_requests()
    again = Store(tmp_path)
    assert again.session_ids() == ["s-1", "s-2"]
    s1 = again.session("s-1")
    assert (s1["metadata"], s1["display_name"], s1["finished"]) == ({"who": "me"}, "first", "success")
    assert again.session("s-2")["metadata"] == {} and again.session("s-3") is None
    assert again.last_request("s-1:train:0") == touched
    (tmp_path / "last_requests.json").write_text("{not json")  # a damaged file: times from the records
    assert Store(tmp_path).last_request("s-1:train:0") == Store(tmp_path).run("s-1:train:0")["created"]
