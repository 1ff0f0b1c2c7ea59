"""The batch and the actors' concurrency scale with the GPUs given (launch/scale.py).

Pure config arithmetic, no Ray and no GPU: on the CPU the defaults are exactly those the project
was tuned with; with GPUs each actor plays 256 sequences a GPU and the batch grows until replay's
staleness bound admits them all (checked against the real `ReplayBuffer`); a number given on the
command line always wins, even one equal to a CPU default; a resumed run keeps its batch.
"""

import re

import pytest
import tyro

from actors.actor import ActorConfig
from launch.config import PROG, Config, resumed_config
from learner.config import LearnerConfig
from replay.buffer import ReplayBuffer


def test_the_cpu_defaults_are_unchanged():
    cfg = Config()
    assert (cfg.groups_per_step, cfg.actor.concurrent_groups, cfg.actor.worker_threads) == (16, 4, 8)
    assert (ActorConfig().concurrent_groups, ActorConfig().worker_threads) == (4, 8)  # an actor built alone
    rank = Config(colocate=True).rank_actor
    assert (rank.groups_in_flight, rank.env_threads) == (4, 8)
    # GPUs elsewhere do not scale what runs on the CPU: learners on GPUs with actors on the CPU,
    # a colocated run whose ranks are on the CPU (the evaluator's --actor.gpus aside)
    assert Config(learners=1, learner=LearnerConfig(gpus=1)).groups_per_step == 16
    cfg = Config(colocate=True, actor=ActorConfig(gpus=0.5))
    assert (cfg.groups_per_step, cfg.rank_actor.groups_in_flight, cfg.rank_actor.env_threads) == (16, 4, 8)
    with pytest.raises(ValueError, match=re.escape("--learner.groups-per-step (16) must be a multiple of --learners (3)")):
        Config(learners=3)  # as before: 16 on the CPU, never rounded
    # 128 sequences a step on the CPU whatever the group: 8 groups of 16, 22 of 6 (132)
    assert Config(actor=ActorConfig(group_size=16)).groups_per_step == 8
    assert Config(actor=ActorConfig(group_size=6)).groups_per_step == 22
    assert Config(actor=ActorConfig(group_size=16), colocate=True).groups_per_step == 8


@pytest.mark.parametrize("actors, gpus, group_size, eta, learners, in_flight, threads, batch", [
    (4, 1.0, 8, 1, 4, 32, 64, 64),      # 256 sequences a GPU; the bound admits 2B = 128 groups
    (6, 0.5, 8, 1, 2, 16, 32, 48),      # two actors a GPU
    (4, 1.0, 8, 0, 4, 32, 64, 128),     # η 0 admits B in flight
    (4, 1.0, 8, 3, 4, 32, 64, 32),      # η 3 admits 4B
    (4, 1.0, 8, 1, 3, 32, 64, 66),      # rounded up to a multiple of --learners
    (2, 0.5, 16, 1, 2, 8, 32, 8),       # never below the CPU's 128 sequences (8 groups of 16)
    (2, 0.05, 8, 1, 2, 4, 8, 16),       # never below the CPU's 4 groups and 8 threads
    (1, 0.25, 8, 1, 1, 8, 16, 16),
])
def test_actors_on_gpus_scale_their_groups_and_the_batch_admits_them_all(actors, gpus, group_size, eta, learners,
                                                                          in_flight, threads, batch):
    cfg = Config(actors=actors, learners=learners, max_staleness=eta,
                 actor=ActorConfig(gpus=gpus, group_size=group_size))
    assert (cfg.actor.concurrent_groups, cfg.actor.worker_threads, cfg.groups_per_step) == (in_flight, threads, batch)
    buffer = ReplayBuffer(cfg.groups_per_step, cfg.staleness_bound, learners)
    for i in range(actors * in_flight):  # every actor asks for its groups at start: all are granted
        assert buffer.grant(f"actor-{i % actors}") is not None, i


def test_device_cuda_alone_scales_as_a_whole_gpu():
    cfg = Config(actors=2, learners=2, actor=ActorConfig(device="cuda"))
    assert (cfg.actor.concurrent_groups, cfg.groups_per_step) == (32, 32)


@pytest.mark.parametrize("learners, gpus, batch, in_flight, threads", [
    (8, 1.0, 256, 32, 64),   # each rank plays its 32 groups of 8 at once
    (1, 0.5, 16, 16, 32),
    (2, 1.0, 64, 32, 64),
])
def test_colocated_ranks_on_gpus_play_their_whole_share_at_once(learners, gpus, batch, in_flight, threads):
    cfg = Config(colocate=True, learners=learners, learner=LearnerConfig(gpus=gpus))
    rank = cfg.rank_actor
    assert (cfg.groups_per_step, rank.groups_in_flight, rank.env_threads) == (batch, in_flight, threads)
    assert rank.concurrent_groups * learners == cfg.groups_per_step


GPU_NODE = ["--actors", "4", "--actor.gpus", "1", "--learners", "4", "--learner.gpus", "1"]


@pytest.mark.parametrize("flags, expected", [
    ([], (64, 32, 64)),
    (["--learner.groups-per-step", "8"], (8, 32, 64)),
    (["--actor.groups-in-flight", "4"], (16, 4, 8)),  # a CPU default given on a GPU is kept, and B follows it
    (["--actor.groups-in-flight", "2", "--actor.env-threads", "3", "--learner.groups-per-step", "12"], (12, 2, 3)),
    (["--actor.env-threads", "8"], (64, 32, 8)),
])
def test_a_number_given_on_the_command_line_wins(flags, expected):
    cfg = resumed_config(GPU_NODE + flags)
    assert (cfg.groups_per_step, cfg.actor.concurrent_groups, cfg.actor.worker_threads) == expected


def test_a_number_given_wins_in_colocated_mode_and_the_batch_is_still_checked():
    cfg = resumed_config(["--colocate", "--learners", "2", "--learner.gpus", "1", "--actor.groups-in-flight", "3",
                          "--actor.env-threads", "5"])
    assert (cfg.groups_per_step, cfg.rank_actor.groups_in_flight, cfg.rank_actor.env_threads) == (64, 3, 5)
    with pytest.raises(ValueError, match=re.escape("--learner.groups-per-step (10) must be a multiple of --learners (4)")):
        Config(actors=4, learners=4, actor=ActorConfig(gpus=1), learner=LearnerConfig(gpus=1, groups_per_step=10))
    with pytest.raises(ValueError, match="--actor.groups-in-flight must be 0 \\(scaled from the GPUs\\) or more"):
        ActorConfig(groups_in_flight=-1)


def test_a_resumed_run_keeps_the_batch_it_started_with(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    first = Config(actors=4, learners=4, logdir=str(run), actor=ActorConfig(gpus=1), learner=LearnerConfig(gpus=1))
    (run / "config.json").write_text(first.to_json())  # the fields as given: 0, scaled
    assert first.learner.groups_per_step == 0 and first.groups_per_step == 64
    more = resumed_config(["--resume", str(run), "--actors", "8"])  # more actors: safe mid-run
    assert (more.actors, more.groups_per_step) == (8, 64)
    assert Config(actors=8, learners=4, actor=ActorConfig(gpus=1), learner=LearnerConfig(gpus=1)).groups_per_step == 128


def test_help_says_how_the_defaults_scale(capsys):
    with pytest.raises(SystemExit):
        tyro.cli(Config, args=["--help"], prog=PROG)
    text = " ".join(capsys.readouterr().out.split())
    for phrase in ("0 scales it from the actor's GPUs: 4 on the CPU", "0 scales it from the GPUs given: 128 sequences on the CPU",
                   "0 scales them with the episodes in flight: 8 on the CPU", "A number given wins"):
        assert phrase in text, phrase
