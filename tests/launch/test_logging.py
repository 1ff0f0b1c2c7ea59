"""What a run logs besides the training scalars: the environments' per-episode `info` numbers as
`env/<key>` means, sample episodes as text, and the same scalars in W&B (offline) or MLflow when
asked. A real actor (torch engine, tiny model) plays into a local replay; TensorBoard's own reader
reads the events back. The W&B run is a whole job in the slow tier."""

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
    board.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("] evaluating v0")
    assert "step 0/2 | eval - | groups in 3 | reward" in lines[1] and "groups in" not in lines[2]


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


@pytest.mark.slow
@pytest.mark.xfail(reason="wandb 0.31 offline runs write no files/wandb-summary.json; the history is only in the "
                          "binary run-*.wandb file, which this test does not read back yet", strict=False)
def test_wandb_offline_gets_the_scalars_tensorboard_gets(tmp_path):
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    run = subprocess.run([sys.executable, "-m", "launch.async", "--steps", "2", "--actors", "2", "--learners", "1",
                          "--eval-episodes", "4", "--learner.groups-per-step", "2", "--log.wandb", "tandem-test",
                          "--log.samples-every", "1", "--logdir", str(run_dir)],
                         capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [summary] = list(run_dir.glob("wandb/offline-run-*/files/wandb-summary.json"))
    logged = json.loads(summary.read_text())
    scalars = read_scalars(str(run_dir))
    assert len(scalars) > 30
    for tag, values in scalars.items():  # the same names, and the last value of each
        assert tag in logged, tag
        assert logged[tag] == pytest.approx(values[-1][1], rel=1e-6, abs=1e-6), tag
    assert "samples" in logged  # the sample episodes' table


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
