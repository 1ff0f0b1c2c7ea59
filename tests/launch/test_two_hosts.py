"""The main job on a real two-host Ray cluster, run as a user with two machines would.

The cluster (tests/launch/twohosts.py) is a head started with `ray start --head` on an address of
the test's own and a worker started with `ray start --address=...` inside its own network
namespace, with token authentication, so that one host's loopback is not the other's: a part
that listened on loopback, a rendezvous made on the driver, or shared memory between nodes would
fail here as they would between two machines. The head has 1 CPU and the worker 4, so replay and
the learners (packed together) must go to the worker, and the two actors (spread) one to each;
a second cluster of 2 + 2 CPUs splits the learner ranks between the hosts.
"""

import json
import re
import subprocess
import sys

import pytest

from launch.plot import read_scalars
from tests.launch.twohosts import two_host_cluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    with two_host_cluster(head_cpus=1, worker_cpus=4) as c:
        yield c


def job(cluster, *args, cwd, env=None, timeout=900):
    return subprocess.run([sys.executable, "-m", "launch.async", "--ray-address", cluster.address, *args],
                          cwd=cwd, env=env or cluster.env, capture_output=True, text=True, timeout=timeout)


def placement(stdout: str) -> dict[str, str]:
    """part -> node address, from the table the job prints at start."""
    return dict(re.findall(r"^\s+(replay|learner-\d+|actor-\d+)\s+(\S+)\s", stdout, re.MULTILINE))


def test_a_job_runs_across_two_hosts(cluster, tmp_path):
    # A user's environment module beside the launch directory: the job must ship it to the nodes.
    (tmp_path / "cluster_maze.py").write_text("from envs.maze import MazeEnv\n\n\nclass Maze(MazeEnv):\n    pass\n")
    logdir = tmp_path / "run"
    run = job(cluster, "--env", "cluster_maze:Maze", "--model", "builtin:maze", "--actors", "2", "--learners", "2",
              "--steps", "5", "--learner.groups-per-step", "4", "--eval-episodes", "8", "--logdir", str(logdir),
              cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "done: 5 steps" in run.stdout
    where = placement(run.stdout)
    assert where["replay"] == where["learner-0"] == where["learner-1"] == cluster.worker_ip, run.stdout
    assert {where["actor-0"], where["actor-1"]} == {cluster.head_ip, cluster.worker_ip}, run.stdout
    scalars = read_scalars(str(logdir))
    assert [s for s, _ in scalars["learner/loss"]] == [1, 2, 3, 4, 5]
    assert scalars["replay/groups_in_socket"][-1][1] > 0  # the head's actor: over the network
    assert scalars["replay/groups_in_shared_memory"][-1][1] > 0  # the worker's actor, beside replay


def test_learner_ranks_on_two_hosts_train_together(tmp_path):
    """2 CPUs a host: replay and 2 learners (3 CPUs) cannot all go on one, so the ranks are split
    and their process group forms across the hosts, at the address rank 0's node gave."""
    with two_host_cluster(head_cpus=2, worker_cpus=2) as split:
        logdir = tmp_path / "split"
        run = job(split, "--actors", "1", "--learners", "2", "--steps", "3", "--learner.groups-per-step", "4",
                  "--eval-episodes", "8", "--logdir", str(logdir), cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    where = placement(run.stdout)
    assert {where["learner-0"], where["learner-1"]} == {split.head_ip, split.worker_ip}, run.stdout
    assert [s for s, _ in read_scalars(str(logdir))["learner/loss"]] == [1, 2, 3]


def test_a_node_that_lacks_the_environment_stops_the_job_at_start(cluster, tmp_path):
    # Installed on the driver only (a site-packages directory on its PYTHONPATH): not shipped, and
    # the nodes' Ray workers cannot import it.
    site = tmp_path / "site-packages"
    site.mkdir()
    (site / "driver_only_env.py").write_text("from envs.maze import MazeEnv\n\n\nclass Maze(MazeEnv):\n    pass\n")
    env = {**cluster.env, "PYTHONPATH": str(site)}
    run = job(cluster, "--env", "driver_only_env:Maze", "--model", "builtin:maze", "--steps", "1", cwd=tmp_path,
              env=env, timeout=600)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "cannot run this job" in run.stderr
    for ip in (cluster.head_ip, cluster.worker_ip):
        assert re.search(rf"node {re.escape(ip)} .*--env driver_only_env:Maze", run.stderr), run.stderr[-2000:]


def test_joining_without_the_clusters_token_fails_with_what_to_set(cluster, tmp_path):
    env = {k: v for k, v in cluster.env.items() if not k.startswith("RAY_AUTH")}
    run = job(cluster, "--steps", "1", cwd=tmp_path, env=env, timeout=300)
    assert run.returncode == 2
    assert f"could not join the Ray cluster at {cluster.address}" in run.stderr
    assert "RAY_AUTH_TOKEN" in run.stderr


def test_a_run_without_ray_address_starts_its_own_ray_even_with_a_cluster_about(cluster):
    """Once `ray start` has run on a machine (or RAY_ADDRESS is set), a plain run must still start
    a Ray of its own rather than join that cluster (or fail trying)."""
    code = ("import json, ray; from launch import cluster; cluster.start_local(1, {}); "
            "print(json.dumps([n['NodeManagerAddress'] for n in ray.nodes()]))")
    run = subprocess.run([sys.executable, "-c", code], env={**cluster.env, "RAY_ADDRESS": cluster.address},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    [address] = json.loads(run.stdout.strip().splitlines()[-1])  # one node: this job's own
    assert address not in (cluster.head_ip, cluster.worker_ip)
