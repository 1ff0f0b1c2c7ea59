"""What a run logs besides the training scalars: the environments' per-episode `info` numbers as
`env/<key>` means, sample episodes as text, and the same scalars in W&B (offline) or MLflow when
asked. A real actor (torch engine, tiny model) plays into a local replay; TensorBoard's own reader
reads the events back; an offline W&B run is read back from its run file (a whole job too, in the slow tier)."""

import json
import os
import subprocess
import sys
import threading

import pytest

from actors.actor import Actor, ActorConfig
from actors.torch_engine import TorchEngine
from envs.base import TextEnv
from launch.monitor import Board, InfoMeans, sample_rows
from launch.plot import read_scalars
from policy.load import LoraSpec
from replay.buffer import ReplayBuffer
from replay.client import LocalReplay
from weights.local import InProcessWeights


class Counting(TextEnv):
    """Two turns; the last step's info carries numbers (and things that are not numbers)."""

    def _reset(self, options):
        self.turns = 0
        return "count", {}

    def _step(self, text):
        self.turns += 1
        done = self.turns == 2
        info = {"turns_used": self.turns, "chars": len(text), "name": "counting", "flag": True, "bad": float("nan")}
        return "again", float(len(text) % 2), done, False, info


def play(tiny_model, chat, groups: int) -> dict:
    from tests.actors.test_actor import random_adapter

    engine = TorchEngine(tiny_model, LoraSpec(rank=4))
    weights = InProcessWeights()
    weights.publish(random_adapter(engine, version=0, scale=0.0))
    cfg = ActorConfig(group_size=4, groups_in_flight=2, max_new_tokens=4)
    buffer = ReplayBuffer(groups_per_step=2, max_staleness=100)
    actor = Actor(cfg, "actor-0", engine, chat, Counting, LocalReplay(buffer), weights.subscriber())
    actor.run(threading.Event(), max_groups=groups)
    return actor.stats()


def test_info_numbers_become_env_means_and_samples_come_as_text(tiny_model, chat):
    stats = play(tiny_model, chat, groups=3)
    n = stats["trajectories"]  # 3 groups of 4, or 4 when two finish together
    assert n >= 12 and stats["info_n/turns_used"] == n
    assert stats["info_sum/turns_used"] == 2.0 * n  # every episode's last step: turn 2
    assert {k for k in stats if k.startswith("info_")} == {"info_sum/turns_used", "info_n/turns_used",
                                                            "info_sum/chars", "info_n/chars"}
    means = InfoMeans()
    assert means.scalars([stats])["env/turns_used"] == 2.0
    assert means.scalars([stats]) == {}  # nothing new since the last call
    rows = sample_rows([{}, stats])
    assert len(rows) == 4 and {r["actor"] for r in rows} == {"actor-0"}
    assert all("count" in r["text"] and "again" in r["text"] for r in rows)  # the prompt and the observation
    assert all(r["finish_reason"] == "terminated" and r["reward"] in (0.0, 1.0, 2.0) for r in rows)


def test_info_means_over_actors_and_a_restart():
    means = InfoMeans()
    a = {"info_sum/x": 10.0, "info_n/x": 5}
    b = {"info_sum/x": 2.0, "info_n/x": 1}
    assert means.scalars([a, b]) == {"env/x": 2.0}
    assert means.scalars([{"info_sum/x": 19.0, "info_n/x": 8}, b]) == {"env/x": 3.0}  # (21 - 12) / (9 - 6)
    assert means.scalars([{"info_sum/x": 1.0, "info_n/x": 1}]) == {"env/x": 1.0}  # counters went back: afresh


def test_greedy_plays_become_the_greedy_policys_mean_over_the_tasks_since_the_last_step():
    """--actor.greedy-play: what the greedy plays achieved on the groups pushed since the last
    step, over the actors, as `rollout/greedy_outcome`; actors without greedy plays add nothing."""
    means = InfoMeans()
    assert means.scalars([{"groups": 3}]) == {}
    a, b = {"greedy_plays": 4, "greedy_outcome_sum": 3.0}, {"greedy_plays": 1, "greedy_outcome_sum": 0.0}
    assert means.scalars([a, b]) == {"rollout/greedy_outcome": 0.6}
    assert means.scalars([{"greedy_plays": 6, "greedy_outcome_sum": 5.0}, b]) == {"rollout/greedy_outcome": 1.0}


def test_the_board_writes_sample_text_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = Board(str(tmp_path), steps=5)
    board.scalars(3, {"rollout/reward_mean": 0.5})
    board.text(3, "samples", [{"reward": 1.0, "text": "a | b\nc"}])
    board.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    [event] = acc.Tensors("samples/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 3 and "reward | text" in text and "a \\| b<br>c" in text


def test_the_progress_line_shows_groups_reaching_replay_before_the_first_step(tmp_path, capsys):
    board = Board(str(tmp_path), steps=2)
    board.note("evaluating v0")
    board.progress(0, groups_in=3)
    board.progress(0)
    board.progress(0, groups_in=5, dropped=12)
    board.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("] evaluating v0")
    assert "step 0/2 | eval - | groups in 3 | reward" in lines[1] and "groups in" not in lines[2]
    assert "| groups in 5 (+12 equal, dropped) | reward" in lines[3]


def test_a_missing_logging_library_is_refused_at_start(monkeypatch):
    import importlib.util

    from launch.config import Config
    from launch.sinks import LogConfig

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "mlflow") else
                        real(name, *a))
    with pytest.raises(ValueError, match="--log.wandb needs the wandb package: pip install wandb"):
        Config(log=LogConfig(wandb="proj"))
    with pytest.raises(ValueError, match="--log.mlflow needs the mlflow package"):
        Config(log=LogConfig(mlflow="file:./mlruns"))
    with pytest.raises(ValueError, match="--log.samples-every"):
        LogConfig(samples_every=-1)


def wandb_history(run_dir) -> dict[str, list[tuple[int, object]]]:
    """What an offline W&B run logged, tag -> [(step, value)], read from its run-*.wandb file.

    wandb ≥ 0.31 writes no files/wandb-summary.json offline: the history is only in that file, a
    LevelDB-style log (a 7-byte header ":W&B", 0xBEE1, version 0; 32 KiB blocks of records, each
    a 7-byte header crc32 / length / type and a chunk) of wandb's Record protobufs. A wandb that
    changes the format fails here, loudly."""
    import struct

    from wandb.proto import wandb_internal_pb2

    [path] = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), data[:7]
    block, pos, chunks, out, kinds = 32768, 7, b"", {}, set()
    while pos < len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunks, pos = chunks + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind not in (1, 4):  # FULL, or the LAST chunk of a record
            assert kind in (2, 3), f"record type {kind} at {pos}"
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunks)
        chunks = b""
        kinds.add(record.WhichOneof("record_type"))
        if record.WhichOneof("record_type") == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            for key, value in items.items():
                out.setdefault(key, []).append((items["_step"], value))
    assert "exit" in kinds, f"{path} holds no exit record (the run was not finished): {sorted(kinds)}"
    return out


def test_wandb_offline_gets_the_scalars_and_the_samples(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from launch.sinks import WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    board = Board(str(run_dir), steps=2, sinks=[WandbSink("tandem-test", str(run_dir), {"steps": 2})])
    board.scalars(1, {"rollout/reward_mean": 0.25, "eval/success_rate": 0.5})
    board.scalars(2, {"rollout/reward_mean": 0.75})
    board.text(2, "samples", [{"reward": 1.0, "text": "hi"}])
    board.close()
    import wandb

    wandb.teardown()  # the run file is complete once wandb's service has stopped (a job's exit does this)
    logged = wandb_history(run_dir)
    assert logged["rollout/reward_mean"] == [(1, 0.25), (2, 0.75)]
    assert logged["eval/success_rate"] == [(1, 0.5)]
    assert logged["samples/_type"] == [(2, "table-file")] and logged["samples/nrows"] == [(2, 1)]
    assert read_scalars(str(run_dir))["rollout/reward_mean"] == [(1, 0.25), (2, 0.75)]


@pytest.mark.slow
def test_wandb_offline_gets_the_scalars_tensorboard_gets(tmp_path):
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    run = subprocess.run([sys.executable, "-m", "launch.async", "--steps", "2", "--actors", "2", "--learners", "1",
                          "--eval-episodes", "4", "--learner.groups-per-step", "2", "--log.wandb", "tandem-test",
                          "--log.samples-every", "1", "--logdir", str(run_dir)],
                         capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    logged = wandb_history(run_dir)
    scalars = read_scalars(str(run_dir))
    assert len(scalars) > 30
    for tag, values in scalars.items():  # the same names, and the last value of each
        assert tag in logged, tag
        assert logged[tag][-1][1] == pytest.approx(values[-1][1], rel=1e-6, abs=1e-6), tag
    assert "samples/_type" in logged  # the sample episodes' table


def test_mlflow_gets_the_scalars_and_the_samples(tmp_path):
    pytest.importorskip("mlflow")
    from launch.sinks import MlflowSink

    uri = f"file:{tmp_path / 'mlruns'}"
    board = Board(str(tmp_path / "run"), steps=2, sinks=[MlflowSink(uri, str(tmp_path / "run"), {"steps": 2})])
    board.scalars(1, {"rollout/reward_mean": 0.25, "eval/success_rate": 0.5})
    board.text(1, "samples", [{"reward": 1.0, "text": "hi"}])
    run_id = board.sinks[0].run.info.run_id
    board.close()
    import mlflow

    client = mlflow.tracking.MlflowClient(uri)
    history = client.get_metric_history(run_id, "rollout/reward_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25)]
    assert client.get_run(run_id).data.params["steps"] == "2"
