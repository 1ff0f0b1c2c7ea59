"""Parts that die past their restarts, as the driver sees them (launch/fleet.py, launch/supervise.py):
real Ray, real processes SIGKILLed; each part's place is taken by a small Ray actor that loops
until it is killed, so that no whole job is needed to reach the driver's decision. The job
itself, with its parts killed: tests/launch/test_faults.py."""

import importlib
import os
import signal
import time

import pytest

from launch.config import Config
from launch.fleet import Fleet, RestartsSpent
from launch.parts import LearnerPart
from launch.supervise import GroupFailed, LearnerFailed, LearnerGroup, ReplayService
from learner.trainer import Learner


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning",
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    try:
        yield ray
    finally:
        ray.shutdown()


class Looping:
    """Stands where an actor or a learner rank stands: its long call runs until the process dies."""

    def __init__(self) -> None:
        self.resumed = None

    def pid(self) -> int:
        return os.getpid()

    def run(self) -> None:
        while True:
            time.sleep(1)

    # a learner rank's calls (LearnerGroup.start, check)
    def rendezvous(self) -> str:
        return "tcp://127.0.0.1:1"

    def setup(self, dist_url: str, resume: bool, ports: tuple) -> tuple[str, str]:
        self.resumed = resume
        return ("tcp://127.0.0.1:2", "tcp://127.0.0.1:3")

    def train(self) -> None:
        self.run()

    def where(self) -> dict:
        return {"resumed": self.resumed}

    # the replay service's calls (ReplayService)
    def address(self) -> str:
        return "tcp://127.0.0.1:5999"

    def serve(self) -> None:
        self.run()


def printed(exc: BaseException) -> str:
    """What the driver prints when a part's restarts are spent (launch/async.py)."""
    return importlib.import_module("launch.async").restarts_spent(Config(logdir="/tmp/runs/r1"), exc)


def sigkill(ray, handle) -> None:
    os.kill(ray.get(handle.pid.remote(), timeout=60), signal.SIGKILL)


def lines_until(check, deadline_s: float = 120) -> list[str]:
    """`check()` polled until it says something (or raises)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        lines = check()
        if lines:
            return lines
        time.sleep(0.2)
    raise AssertionError(f"nothing happened in {deadline_s} s")


def test_an_actor_that_dies_past_its_restarts_stops_the_run_with_a_message(ray_local):
    part = ray_local.remote(Looping).options(num_cpus=0, max_concurrency=4)  # pid() answers while run() loops
    fleet = Fleet(lambda i: part.remote(), 2, restarts=1)
    try:
        sigkill(ray_local, fleet.actors[1])
        assert lines_until(fleet.check)[0].startswith("actor-1 died (")
        assert fleet.restarts == [0, 1]
        sigkill(ray_local, fleet.actors[1])  # the new process, killed too: past --actor.restarts 1
        with pytest.raises(RestartsSpent, match=r"^actor-1 died after 1 restart\(s\), the most --actor.restarts 1 "
                                                r"allows") as spent:
            lines_until(fleet.check)
        assert printed(spent.value).endswith("continue the run from its newest checkpoint with  "
                                             "python -m launch.async --resume /tmp/runs/r1")
    finally:
        for a in fleet.actors:
            ray_local.kill(a)


def test_a_learner_group_that_dies_past_its_restarts_stops_with_the_resume_command(ray_local):
    rank = ray_local.remote(Looping).options(num_cpus=0, max_concurrency=4)  # pid() answers while run() loops
    group = LearnerGroup(lambda r: rank.remote(), 2, restarts=1)
    try:
        assert group.start() == ("tcp://127.0.0.1:2", "tcp://127.0.0.1:3")
        sigkill(ray_local, group.ranks[1])
        line = lines_until(group.check)[0]
        assert "the learner group went back to its newest checkpoint (1 of 1 restarts)" in line, line
        # a whole new group, every rank loading the newest checkpoint
        assert [ray_local.get(r.where.remote(), timeout=60)["resumed"] for r in group.ranks] == [True, True]
        sigkill(ray_local, group.ranks[0])
        with pytest.raises(GroupFailed, match=r"^a learner rank died after 1 restart\(s\) of the learner group, the "
                                              r"most --learner.restarts 1 allows"):
            lines_until(group.check)
    finally:
        for r in group.ranks:
            ray_local.kill(r)
    # what the driver prints beside GroupFailed (launch/async.py): the exact command that continues the run
    resume_command = importlib.import_module("launch.async").resume_command
    assert resume_command(Config(logdir="/tmp/runs/my run")) == "python -m launch.async --resume '/tmp/runs/my run'"


def test_a_replay_service_that_dies_past_its_restarts_stops_with_the_resume_command(ray_local):
    part = ray_local.remote(Looping).options(num_cpus=0, max_concurrency=4)
    replay = ReplayService(lambda port: part.remote(), restarts=1, logged=True, timeout=60)
    try:
        sigkill(ray_local, replay.handle)
        line = lines_until(replay.check)[0]
        assert line.startswith("the replay service died (") and "restarted on port 5999" in line, line
        sigkill(ray_local, replay.handle)
        with pytest.raises(RestartsSpent, match=r"^the replay service died after 1 restart\(s\), the most "
                                                r"--replay.restarts 1 allows") as spent:
            lines_until(replay.check)
        assert printed(spent.value).splitlines()[-1] == ("continue the run from its newest checkpoint with  "
                                                         "python -m launch.async --resume /tmp/runs/r1")
    finally:
        ray_local.kill(replay.handle)


class FailingLearner(Learner):
    """A real learner rank in a real gloo group whose step raises on rank 1 while rank 0 waits in a
    collective (a bad batch on one rank), as in FSDP's backward."""

    def setup(self, resume: bool = False) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=self.dist_url, rank=self.rank, world_size=self.world)

    def step(self) -> dict:
        import torch
        import torch.distributed as dist

        if self.rank == 1:
            raise ValueError("token id 70000 is past the vocabulary (65536) in rank 1's batch")
        dist.all_reduce(torch.ones(4))  # rank 0: waits for rank 1, which never comes
        self.steps_done += 1
        return {}


class FailingPart(LearnerPart):
    """The real `LearnerPart.train` (its closing of the rank on error) over `FailingLearner`."""

    def rendezvous(self) -> str:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return f"tcp://127.0.0.1:{s.getsockname()[1]}"

    def setup(self, dist_url: str, resume: bool, ports: tuple) -> None:
        self.learner = FailingLearner(self.cfg.learner, "unused", self.rank, 2, dist_url, replay=None)
        self.learner.setup()
        return ("tcp://127.0.0.1:2", "tcp://127.0.0.1:3") if self.rank == 0 else None


def test_an_error_on_one_learner_rank_stops_the_run_with_that_error_and_no_restart(ray_local, tmp_path):
    cfg = Config(logdir=str(tmp_path), learners=2, steps=5)
    part = ray_local.remote(FailingPart).options(num_cpus=0, max_concurrency=2)
    group = LearnerGroup(lambda r: part.remote(cfg, "unused", r, "tcp://127.0.0.1:1", None), 2, restarts=2)
    try:
        group.start()
        with pytest.raises(LearnerFailed) as failed:
            lines_until(group.check)  # raises before rank 0's collective times out (gloo's default: 30 min)
        text = str(failed.value)
        assert text.startswith("learner rank 1 raised ValueError: token id 70000 is past the vocabulary"), text
        assert "rank 0: RuntimeError" in text and "by peer" in text, text  # gloo's peer failed at once
        assert "ValueError" in str(failed.value.cause)  # the remote traceback, for the driver to print
        assert group.restarts == 0
    finally:
        for r in group.ranks:
            ray_local.kill(r)


def test_a_rank_error_and_its_peers_collective_failure_are_told_apart():
    from launch.supervise import describe, peer_failed

    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:28868")
    assert peer_failed(gloo) and not peer_failed(ValueError("bad batch"))
    assert describe(ValueError("bad batch\nmore")) == "ValueError: bad batch"
