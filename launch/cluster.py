"""Tandem on Ray: joining a cluster, what each part listens on, where it runs, what every node needs.

A local run (no `--ray-address`) starts a Ray of its own, always: never one that a `ray start`
left behind on the machine, and its sockets stay on loopback. Joining a cluster
(`--ray-address`):

- **Token.** Ray 2.52+ authenticates with a token (`RAY_AUTH_MODE=token`, on by default for heads
  that listen beyond loopback from Ray 2.60): the driver needs the token the nodes were started
  with, and a refused join stops at once with a message that says so (`join`).
- **Addresses.** `--replay.host` (default "node" when joining) is what the replay service, the
  weight publisher and learner rank 0's rendezvous listen on, resolved in each part's own process
  (`listen`): "node" is its node's address as Ray knows it; "0.0.0.0" listens on every interface
  and advertises the node's address; anything else is used as given. The learners' rendezvous
  comes from the node rank 0 runs on, and gloo / NCCL are pointed at the interface that holds
  that node's address (`point_collectives`). Frames stay signed with the run's key.
- **One host = one Ray node.** Shared-memory arenas are used only between parts whose Ray node
  ids match (`host_key`): two Ray nodes on one machine (containers, network namespaces) share
  /dev/shm but are two hosts to Ray and to the user, and their groups go over sockets.
- **Placement.** Replay and the learners in one placement group, packed onto as few nodes as
  hold them (PACK); actors spread over the nodes (`--actor.spread`, Ray's SPREAD) or packed by
  Ray's default. A table printed at start says which part runs where. Each part asks for 1 CPU;
  actors and learner ranks also for `--actor.gpus` / `--learner.gpus` (launch/parts.py: how each
  part then sees only its own devices).
- **Code.** The job's packages, and a `--env module:Class` module from outside site-packages,
  travel with the job (Ray's runtime environment, `py_modules`). What pip installed (torch,
  transformers, vLLM) must be on every node, in the driver's versions: a task on every node
  checks that at start, with the user's environment and the model directory, and the job stops
  with what is missing where. A built-in model (a few MB) is copied to nodes that lack it; a Hub
  id is resolved once, by the driver, to a snapshot in its Hugging Face cache, and a node that
  lacks it fetches that revision into the same cache path; any other local model directory must
  be at the same path on every node.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path

PACKAGES = ("actors", "envs", "learner", "launch", "policy", "replay", "weights", "bench", "serve")
"""Tandem's top-level packages: what a cluster run ships to every node."""

COPY_LIMIT = 256 << 20
"""A built-in model directory up to this size is copied to a node that lacks it."""


class JoinError(RuntimeError):
    """The Ray cluster at --ray-address could not be joined."""


def join(address: str, runtime_env: dict) -> None:
    """`ray.init` on the cluster at `address`; JoinError saying what to check if that fails."""
    import ray

    try:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True, logging_level="warning")
    except (ConnectionError, RuntimeError) as exc:
        mode = os.environ.get("RAY_AUTH_MODE", "disabled")
        token = "RAY_AUTH_TOKEN" in os.environ or "RAY_AUTH_TOKEN_PATH" in os.environ
        raise JoinError(
            f"could not join the Ray cluster at {address} ({str(exc).splitlines()[0]}). Check that the head "
            "runs there and its port is reachable from this machine, and that this shell has the cluster's "
            f"token: a head that listens beyond loopback needs RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or "
            f"RAY_AUTH_TOKEN_PATH) on every node and here (here: RAY_AUTH_MODE={mode}, "
            f"token {'set' if token else 'not set'}).") from None


def start_local(num_cpus: int, runtime_env: dict) -> None:
    """A Ray of this job's own on this machine (address="local": never a cluster that `ray start`
    or RAY_ADDRESS points at; joining one is what --ray-address is for)."""
    import ray

    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env,
             log_to_driver=True, logging_level="warning")


HF_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "HF_HUB_CACHE", "HF_TOKEN", "HF_ENDPOINT")
"""The user's Hugging Face settings, passed to every part as they are set for the driver (never
set otherwise: offline mode is the user's choice, and the parts load the resolved directory)."""


def hf_env() -> dict[str, str]:
    """The HF_VARS set in this (the driver's) environment."""
    return {k: os.environ[k] for k in HF_VARS if k in os.environ}


def runtime_env(env_vars: dict, env: str, joining: bool, reward: str = "") -> dict:
    """The job's Ray runtime environment. Local: `env_vars`, with the launch directory on
    PYTHONPATH (where a `--env module:Class` module is imported from, as in this process).
    Joining a cluster: the job's packages and the user's environment module (and the module of
    `--dataset.reward`, `reward`) as `py_modules`."""
    env_vars = dict(env_vars)
    if not joining:
        env_vars["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
        return {"env_vars": env_vars}
    here = Path(__file__).resolve().parent.parent
    modules = [str(here / p) for p in PACKAGES if (here / p).is_dir()]
    for user in (_user_module(env), _user_module(reward)):
        if user is not None and user not in modules:
            modules.append(user)
    return {"env_vars": env_vars, "py_modules": modules, "excludes": ["__pycache__", "*.pyc"]}


def _user_module(env: str) -> str | None:
    """The file or package directory of a `--env module:Class` module to ship; None for a built-in
    environment or one that pip installed (it must be installed on every node: `check_nodes`)."""
    if ":" not in env or env.startswith("skyrl:"):
        return None
    top = env.split(":", 1)[0].split(".")[0]
    spec = importlib.util.find_spec(top)
    if spec is None or spec.origin is None or "-packages" in spec.origin:
        return None
    origin = Path(spec.origin)
    return str(origin.parent if origin.name == "__init__.py" else origin)


# -- inside a part's process ---------------------------------------------------------------------
def node_id() -> str | None:
    """This process's Ray node id (None outside Ray)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def host_key() -> str | None:
    """Which host this process is on, for same-host shared memory: its Ray node (None outside
    Ray: the replay client and server then use the machine's boot id)."""
    node = node_id()
    return f"ray-node:{node}" if node else None


def node_address() -> str:
    """This node's address as Ray knows it (the one other nodes reach it at)."""
    import ray

    return ray.util.get_node_ip_address()


def listen(host: str) -> tuple[str, str | None]:
    """(bind address, advertised address or None) for this process's sockets, from --replay.host
    as the launcher resolved it ("node", "0.0.0.0", or an address)."""
    if host == "node":
        return node_address(), None
    if host in ("0.0.0.0", "*"):
        return "0.0.0.0", node_address()
    return host, None


def rendezvous(host: str) -> str:
    """The learners' torch.distributed init address, made on rank 0's node: a port free there."""
    bind, advertise = listen(host)
    with socket.socket() as s:
        s.bind((bind, 0))
        port = s.getsockname()[1]
    return f"tcp://{advertise or bind}:{port}"


def point_collectives(address: str) -> None:
    """Point gloo and NCCL at the interface holding `address` (unless the user chose one): by
    default gloo takes the address the hostname resolves to, which in a container or a network
    namespace may not be this node's at all."""
    import psutil

    if address.startswith("127.") or address in ("localhost", "0.0.0.0"):
        return
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
            return


def where() -> dict:
    """What the placement table shows for this process."""
    return {"node": node_id() or "-", "address": node_address(), "host": socket.gethostname(), "pid": os.getpid()}


# -- placement -----------------------------------------------------------------------------------
def bundles(learners: int, gpus: float) -> list[dict]:
    """The placement group's bundles: replay's (1 CPU) and one per learner rank (1 CPU, and `gpus`
    GPUs when above 0)."""
    rank = {"CPU": 1, "GPU": gpus} if gpus > 0 else {"CPU": 1}
    return [{"CPU": 1}] + [dict(rank) for _ in range(learners)]


def placement(learners: int, gpus: float = 0.0, timeout: float = 300.0):
    """A placement group for replay (bundle 0) and the learners (bundles 1..N, each with `gpus`
    GPUs), packed onto as few nodes as hold them. RuntimeError, saying what the cluster lacks, if
    it cannot be placed."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(bundles(learners, gpus), strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout)
    if not ready:
        remove_placement_group(group)
        free, total = ray.available_resources(), ray.cluster_resources()
        raise RuntimeError(f"Ray could not place replay and {learners} learner(s) ({1 + learners} CPUs, "
                           f"{learners * gpus:g} GPUs) within {timeout:g} s; the cluster has "
                           f"{free.get('CPU', 0):g} CPUs free of {total.get('CPU', 0):g} and "
                           f"{free.get('GPU', 0):g} GPUs free of {total.get('GPU', 0):g}")
    return group


def gpu_shortfall(demand: list[tuple[str, int, float]], have: float) -> str | None:
    """What is wrong when the parts ask for more GPUs than the cluster has (None: they fit).
    `demand`: (what, processes, GPUs each). Fractions are summed: Ray packs them onto GPUs."""
    need = sum(n * g for _, n, g in demand)
    if need <= have + 1e-9:
        return None
    parts = " + ".join(f"{what} {n} × {g:g}" for what, n, g in demand if g > 0)
    return (f"the parts ask for {need:g} GPUs ({parts}); the Ray cluster has {have:g}. Use fewer --actors or "
            "--learners, smaller --actor.gpus / --learner.gpus (a fraction shares a GPU), more GPUs, or 0 to run "
            "a part on the CPU")


def in_bundle(group, index: int) -> dict:
    """Ray options that run a part in bundle `index` of `group`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)}


def table(rows: list[tuple[str, dict]], driver: dict) -> str:
    """The placement table: part, node address, Ray node id, host name, pid."""
    lines = [f"placement ({len({r['node'] for _, r in rows})} node(s); the driver is on {driver['address']}):",
             f"  {'part':<12}{'address':<18}{'node':<10}{'host':<20}pid"]
    for part, r in rows:
        lines.append(f"  {part:<12}{r['address']:<18}{r['node'][:8]:<10}{r['host'][:19]:<20}{r['pid']}")
    return "\n".join(lines)


# -- what every node needs -----------------------------------------------------------------------
def manifest(model_path: str) -> dict | None:
    """Names and sizes of the files of a local model directory (None for a Hub id), and their
    bytes where it is a built-in model small enough to copy to the nodes."""
    from policy.cache import cache_dir
    from policy.load import BUILTIN_DIRS, hub_snapshot_of

    path = Path(model_path)
    if not path.is_dir():
        return None
    hub = hub_snapshot_of(path)
    files = _model_files(path, hub is not None)
    builtin = path.parent == cache_dir() and path.name in BUILTIN_DIRS.values()
    data = None
    if builtin and sum(files.values()) <= COPY_LIMIT:
        data = {name: (path / name).read_bytes() for name in files}
    return {"path": str(path), "files": files, "data": data, "hub": hub}


def _model_files(path: Path, hub: bool) -> dict[str, int]:
    """{relative name: size} of a model directory's files; of a Hub snapshot, only those Tandem
    fetches (a snapshot may hold other copies of the weights, which no node needs)."""
    from fnmatch import fnmatch

    from policy.load import MODEL_FILES

    files = {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}
    return {n: size for n, size in files.items() if not hub or any(fnmatch(n, p) for p in MODEL_FILES)}


def inspect_node(env: str, model: dict | None) -> dict:
    """Run on a node: its versions, and the problems a part would hit there (Tandem or its
    dependencies missing, the user's environment not importable, the model directory absent or
    different); a built-in model that is missing is copied here first."""
    import platform

    out = {"where": where(), "python": platform.python_version(), "problems": []}
    for name in ("ray", "torch", "transformers", "peft", "zmq"):
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - whatever stops the import is the message
            out["problems"].append(f"cannot import {name}: {exc}")
    for name in ("launch.parts", "actors.actor", "learner.trainer", "replay.server", "envs"):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001
            out["problems"].append(f"cannot import Tandem's {name}: {type(exc).__name__}: {exc}")
    try:
        from envs import env_entry

        env_entry(env)
    except Exception as exc:  # noqa: BLE001
        out["problems"].append(f"--env {env}: {type(exc).__name__}: {exc}")
    if model is not None:
        out["problems"] += _check_model(model)
    return out


def _check_model(model: dict) -> list[str]:
    path = Path(model["path"])
    hub = model.get("hub")
    if not path.is_dir() and model["data"] is not None:
        _copy_model(path, model["data"])
    if not path.is_dir() and hub is not None:
        # The driver resolved a Hub id to this snapshot: the node fetches the same revision into a
        # cache at the same path (with its own HF_* settings, which the job passes through).
        from policy.load import ModelNotFound, _hub_snapshot

        repo, revision, cache = hub
        try:
            _hub_snapshot(repo, cache=cache, revision=revision)
        except ModelNotFound as exc:
            return [f"the model {repo} (revision {revision}) is not in this node's Hugging Face cache {cache} and "
                    f"could not be fetched: {exc}"]
        except OSError as exc:  # the cache path cannot be written here
            return [f"the model {repo} could not be fetched into {cache} on this node ({exc}): give every node "
                    "the same HF_HOME / HF_HUB_CACHE, writable, or a shared filesystem"]
    if not path.is_dir():
        return [f"the model directory {path} is not on this node: put it at the same path on every node "
                "(or on a shared filesystem), or pass a Hub id"]
    here = _model_files(path, hub is not None)
    if here != model["files"]:
        differ = sorted(set(here.items()) ^ set(model["files"].items()))
        return [f"the model directory {path} here differs from the driver's (files {', '.join(n for n, _ in differ[:4])}): "
                "make it the same checkpoint on every node"]
    return []


def _copy_model(path: Path, data: dict[str, bytes]) -> None:
    """Write a built-in model's files at `path`, atomically (a temporary directory, renamed)."""
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    for name, blob in data.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(blob)
    try:
        tmp.rename(path)
    except OSError:  # another job copied it meanwhile
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def check_nodes(env: str, model_path: str) -> list[dict]:
    """`inspect_node` on every alive node of the cluster, compared with this process: the reports,
    each with its problems (a version that differs from the driver's is one)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    model = manifest(model_path)
    model_ref = ray.put(model)
    task = ray.remote(num_cpus=0)(inspect_node)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
        env, model_ref) for n in nodes]
    mine = inspect_node(env, None)
    reports = []
    for node, ref in zip(nodes, refs):
        try:
            report = ray.get(ref, timeout=600)
        except Exception as exc:  # noqa: BLE001 - a node that cannot even run the check
            report = {"where": {"address": node.get("NodeManagerAddress", "?"), "node": node["NodeID"]},
                      "problems": [f"the check could not run there: {type(exc).__name__}: {str(exc)[:500]}"]}
        for name in ("python", "ray", "torch", "transformers", "peft"):
            if name in report and report[name] != mine.get(name):
                report["problems"].append(f"{name} {report[name]} there, {mine.get(name)} on the driver")
        reports.append(report)
    return reports


def problems_text(reports: list[dict]) -> str:
    """The nodes' problems, one line each (empty: none)."""
    return "\n".join(f"  node {r['where']['address']} ({r['where']['node'][:8]}): {p}"
                     for r in reports for p in r["problems"])

