"""launch/cluster.py piece by piece, in this process: addresses, what a cluster run ships, and the
check every node runs at start. The two-host run itself is tests/launch/test_two_hosts.py."""

import os
import socket

import pytest

from launch import cluster
from replay.wire import advertised


def test_listen_resolves_the_replay_host_setting():
    here = cluster.node_address()
    assert cluster.listen("127.0.0.1") == ("127.0.0.1", None)
    assert cluster.listen("node") == (here, None)
    assert cluster.listen("0.0.0.0") == ("0.0.0.0", here)  # every interface, reached at the node's address
    assert cluster.listen("10.9.8.7") == ("10.9.8.7", None)


def test_an_endpoint_bound_on_every_interface_is_advertised_at_the_node_address():
    assert advertised("tcp://0.0.0.0:5555", "10.0.0.2") == "tcp://10.0.0.2:5555"
    assert advertised("tcp://127.0.0.1:7", None) == "tcp://127.0.0.1:7"


def test_the_replay_service_and_the_weight_channel_advertise_what_they_are_reached_at():
    from replay.buffer import ReplayBuffer
    from replay.zmq_client import ZmqActorReplay
    from replay.server import ReplayServer
    from policy.adapter import Adapter
    from weights.publisher import WeightPublisher
    from weights.subscriber import WeightSubscriber
    from tests.replay.helpers import make_group

    import torch

    key = os.urandom(32)
    server = ReplayServer(ReplayBuffer(1, max_staleness=10), "tcp://0.0.0.0:*", key=key, advertise="127.0.0.1")
    endpoint = server.start()
    publisher = WeightPublisher("0.0.0.0", key=key, advertise="127.0.0.1")
    try:
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")
        actor = ZmqActorReplay(endpoint, actor="a", key=key, arena_bytes=0)
        assert actor.push(make_group(seed=1)) == "stored"
        assert all(e.startswith("tcp://127.0.0.1:") for e in publisher.endpoints)
        sub = WeightSubscriber(publisher.endpoints, key=key)
        publisher.publish(Adapter(3, "m", {"r": 1}, {"w": torch.ones(2)}))
        got = sub.latest(10)
        assert got is not None and got.version == 3
        sub.close()
    finally:
        publisher.close()
        server.stop()


def test_a_local_run_puts_the_launch_directory_on_the_path_and_a_cluster_run_ships_the_code(tmp_path, monkeypatch):
    local = cluster.runtime_env({"A": "1"}, "maze", joining=False)
    assert local["env_vars"]["A"] == "1" and os.getcwd() in local["env_vars"]["PYTHONPATH"].split(os.pathsep)
    (tmp_path / "my_cluster_env.py").write_text("from envs.maze import MazeEnv\n\nclass Maze(MazeEnv):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    joined = cluster.runtime_env({"A": "1"}, "my_cluster_env:Maze", joining=True)
    shipped = {os.path.basename(m) for m in joined["py_modules"]}
    assert set(cluster.PACKAGES) <= shipped and "my_cluster_env.py" in shipped
    assert "PYTHONPATH" not in joined["env_vars"]  # the driver's directory means nothing on another node
    installed = cluster.runtime_env({}, "pytest:Item", joining=True)  # from site-packages: never shipped
    assert len(installed["py_modules"]) == len(cluster.PACKAGES)


def test_a_cluster_run_ships_every_package_the_project_installs():
    """The weight channel (weights/) is imported by actors and learners on every node."""
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(cluster.__file__).parents[1] / "pyproject.toml").read_text())
    installed = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert set(cluster.PACKAGES) == installed and "weights" in cluster.PACKAGES


@pytest.fixture
def builtin_model(tmp_path, monkeypatch):
    """A built-in model's cache entry (its files are what matters here, not what they hold)."""
    from policy.load import BUILTIN_DIRS

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "cache" / BUILTIN_DIRS["builtin:tiny"]
    (path / "sub").mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "sub" / "weights.bin").write_bytes(os.urandom(1000))
    return path


def test_a_node_without_the_builtin_model_gets_a_copy(builtin_model):
    import shutil

    manifest = cluster.manifest(str(builtin_model))
    original = {p.name: p.read_bytes() for p in builtin_model.rglob("*") if p.is_file()}
    shutil.rmtree(builtin_model)  # as on a node that never built it
    report = cluster.inspect_node("maze", manifest)
    assert report["problems"] == []
    assert {p.name: p.read_bytes() for p in builtin_model.rglob("*") if p.is_file()} == original
    assert not [p for p in builtin_model.parent.iterdir() if p.name.startswith(".")]  # no temporary left


def test_a_node_whose_model_differs_or_lacks_a_user_checkpoint_is_reported(builtin_model, tmp_path):
    manifest = cluster.manifest(str(builtin_model))
    (builtin_model / "sub" / "weights.bin").write_bytes(b"shorter")
    [problem] = cluster.inspect_node("maze", manifest)["problems"]
    assert "differs from the driver's" in problem and "sub/weights.bin" in problem
    user = tmp_path / "my-checkpoint"
    user.mkdir()
    (user / "config.json").write_text("{}")
    manifest = cluster.manifest(str(user))
    assert manifest["data"] is None  # a user's checkpoint is never copied around
    user.joinpath("config.json").unlink()
    user.rmdir()
    [problem] = cluster.inspect_node("maze", manifest)["problems"]
    assert "is not on this node" in problem and str(user) in problem
    assert cluster.manifest("Qwen/Qwen2.5-0.5B-Instruct") is None  # a Hub id: each node resolves it


def test_a_node_that_cannot_import_the_environment_is_reported():
    report = cluster.inspect_node("no_such_module_here:Env", None)
    assert any("--env no_such_module_here:Env" in p for p in report["problems"])
    text = cluster.problems_text([report])
    assert text.startswith("  node ") and "no_such_module_here" in text


def test_the_collectives_are_pointed_at_the_interface_of_the_node_address(monkeypatch):
    import psutil

    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # unset here, and as before afterwards
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    cluster.point_collectives("127.0.0.1")  # loopback: gloo's own choice is right
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    found = [(n, a.address) for n, addrs in psutil.net_if_addrs().items() for a in addrs
             if a.family == socket.AF_INET and not a.address.startswith("127.")]
    if not found:
        pytest.skip("this machine has no network interface besides loopback")
    name, address = found[0]
    cluster.point_collectives(address)
    assert os.environ["GLOO_SOCKET_IFNAME"] == name == os.environ["NCCL_SOCKET_IFNAME"]

