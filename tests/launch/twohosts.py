"""A real two-host Ray cluster on one machine, for tests of what crosses hosts.

A single-node `ray.init()` hides every bug where one host hands another an address that only
means something locally (127.0.0.1, a Unix socket, a path in /dev/shm). Here the head runs in
this machine's network namespace on an address of its own, and the worker runs in a network
namespace of its own joined to it by a veth pair, so each host's loopback is its own:

    with two_host_cluster(head_cpus=1, worker_cpus=4) as cluster:
        subprocess.run([sys.executable, "driver.py", cluster.address], env=cluster.env, check=True)

Decisions:
- Drivers run as subprocesses with `cluster.env`; the pytest process never calls `ray.init`,
  since other tests start their own local Ray in it.
- Ray 2.60 demands token auth for a head that listens beyond loopback, so every process we
  start, and `cluster.env`, carries RAY_AUTH_MODE=token and a fresh RAY_AUTH_TOKEN.
- Teardown never runs `ray stop`, which kills every Ray on the machine. It SIGKILLs exactly what
  this cluster started: each Ray process carries our unique --temp-dir on its command line, and
  everything in our namespace or our sessions, with their children; then it deletes the netns
  and the veth. Not SIGTERM: told all at once, most of Ray's processes were still running 5 s
  later, and a throwaway cluster has nothing to flush. Ray writes its `ray_current_cluster`
  address file into --temp-dir, which goes too, so a later plain `ray.init()` never finds it.
- Netns, veth and temp-dir names carry one random tag; the /24 is one no address or route on
  the machine overlaps; the GCS port lies above Ray's worker ports (10002-19999) and below
  Linux's ephemeral ones. Short temp dirs keep Ray's Unix socket paths under their limit.
- It skips only where the machine cannot build the second host (not root, no `ip`, netns or
  veth refused); any failure after that raises with the tail of the Ray logs.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import ipaddress
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

STARTUP_TIMEOUT_S = 90.0
GCS_PORTS = range(20000, 32768)

# Joins the cluster and waits until exactly the two expected hosts are alive.
WAIT_FOR_NODES = """
import sys, time
import ray
address, *ips = sys.argv[1:]
ray.init(address=address, log_to_driver=False, logging_level="WARNING")
while sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]) != sorted(ips):
    time.sleep(0.5)
"""


@dataclasses.dataclass(frozen=True)
class TwoHostCluster:
    address: str
    """The head's GCS address, `head_ip:port`, for `ray.init(address=...)`."""
    head_ip: str
    """The head's address, in this machine's network namespace."""
    worker_ip: str
    """The worker's address, inside `netns`."""
    env: dict[str, str]
    """os.environ plus the token auth every driver of this cluster needs."""
    netns: str
    """The worker's network namespace (`ip netns exec <netns> ...`)."""


@contextlib.contextmanager
def two_host_cluster(head_cpus: int = 1, worker_cpus: int = 4) -> Iterator[TwoHostCluster]:
    """Start the head and the worker, yield when both are alive, and end all of it on exit."""
    if os.geteuid() != 0:
        pytest.skip("two_host_cluster needs root to create a network namespace and a veth pair")
    if shutil.which("ip") is None:
        pytest.skip("two_host_cluster needs the `ip` command (iproute2)")
    tag = secrets.token_hex(3)
    netns, host_veth, ns_veth = f"tnd-{tag}", f"tnd{tag}h", f"tnd{tag}w"
    temp_dirs = [Path(f"/tmp/tnd-{tag}-h"), Path(f"/tmp/tnd-{tag}-w")]
    started: list[subprocess.Popen] = []  # each `ray start` leads a session of its own

    def cleanup() -> None:
        _end_processes(temp_dirs, netns, sessions=[p.pid for p in started])
        for p in started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)  # reaps it; killed above, so this is at once
        _ip("netns", "delete", netns, check=False)  # takes the namespace's end of the veth with it
        _ip("link", "delete", host_veth, check=False)
        for d in temp_dirs:
            shutil.rmtree(d, ignore_errors=True)

    atexit.register(cleanup)  # in case pytest dies before `finally`
    try:
        head_ip, worker_ip = _link_hosts(netns, host_veth, ns_veth)
        port = _free_port()
        address = f"{head_ip}:{port}"
        env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
        ray = str(Path(sys.executable).parent / "ray")
        common = ["--disable-usage-stats", "--block"]
        head = _spawn([ray, "start", "--head", f"--node-ip-address={head_ip}", f"--port={port}",
                       f"--num-cpus={head_cpus}", "--include-dashboard=false", f"--temp-dir={temp_dirs[0]}",
                       *common], env, temp_dirs[0])
        started.append(head)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        _wait(lambda: _accepts(head_ip, port), [head], deadline, f"the head's GCS to listen on {address}",
              temp_dirs)
        worker = _spawn(["ip", "netns", "exec", netns, ray, "start", f"--address={address}",
                         f"--node-ip-address={worker_ip}", f"--num-cpus={worker_cpus}",
                         f"--temp-dir={temp_dirs[1]}", *common], env, temp_dirs[1])
        started.append(worker)
        waiter = subprocess.Popen([sys.executable, "-c", WAIT_FOR_NODES, address, head_ip, worker_ip], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            _wait(lambda: waiter.poll() is not None, [head, worker], deadline,
                  f"both nodes ({head_ip}, {worker_ip}) to be alive in the cluster at {address}", temp_dirs)
        finally:
            waiter.kill()
            _, err = waiter.communicate()
        if waiter.returncode != 0:
            raise RuntimeError(f"two_host_cluster: the driver waiting for both nodes failed:\n{err[-3000:]}"
                               + _log_tails(temp_dirs))
        yield TwoHostCluster(address, head_ip, worker_ip, env, netns)
    finally:
        cleanup()
        atexit.unregister(cleanup)


def _link_hosts(netns: str, host_veth: str, ns_veth: str) -> tuple[str, str]:
    """Create the namespace and the veth pair between it and us; skip if the machine refuses."""
    net = _free_subnet()
    head_ip, worker_ip = str(net[1]), str(net[2])
    steps = [("netns", "add", netns),
             ("link", "add", host_veth, "type", "veth", "peer", "name", ns_veth),
             ("link", "set", ns_veth, "netns", netns),
             ("addr", "add", f"{head_ip}/{net.prefixlen}", "dev", host_veth),
             ("link", "set", host_veth, "up"),
             ("-n", netns, "addr", "add", f"{worker_ip}/{net.prefixlen}", "dev", ns_veth),
             ("-n", netns, "link", "set", ns_veth, "up"),
             ("-n", netns, "link", "set", "lo", "up")]
    for step in steps:
        run = _ip(*step, check=False)
        if run.returncode != 0:
            pytest.skip(f"two_host_cluster: this machine refused `ip {' '.join(step)}`: {run.stderr.strip()}")
    return head_ip, worker_ip


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 that no address or route on this machine overlaps."""
    used = []
    for line in _ip("-o", "-4", "addr").stdout.splitlines() + _ip("-4", "route").stdout.splitlines():
        for word in line.split()[:4]:  # `4: eth0 inet 10.1.2.3/24 ...`, `10.0.0.0/8 via ...`
            with contextlib.suppress(ValueError):
                used.append(ipaddress.ip_network(word, strict=False))
    for _ in range(1000):
        net = ipaddress.ip_network(f"10.{random.randrange(256)}.{random.randrange(256)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError(f"two_host_cluster: every 10.x.y.0/24 tried overlaps one in use: {used}")


def _free_port() -> int:
    """A port in GCS_PORTS that nothing on this machine is bound to, on any address."""
    for _ in range(100):
        port = random.choice(GCS_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"two_host_cluster: no free port found in {GCS_PORTS}")


def _spawn(cmd: list[str], env: dict[str, str], temp_dir: Path) -> subprocess.Popen:
    temp_dir.mkdir(parents=True)
    with open(temp_dir / "ray-start.log", "w") as log:
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _accepts(ip: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((ip, port), timeout=1):
        return True
    return False


def _wait(ready, procs: list[subprocess.Popen], deadline: float, what: str, temp_dirs: list[Path]) -> None:
    """Poll `ready()` until the deadline; fail at once if one of `procs` exits."""
    while not ready():
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"two_host_cluster: `{' '.join(p.args)}` exited with {p.returncode} "
                                   f"while waiting for {what}" + _log_tails(temp_dirs))
        if time.monotonic() > deadline:
            raise RuntimeError(f"two_host_cluster: gave up after {STARTUP_TIMEOUT_S:.0f} s waiting for {what}"
                               + _log_tails(temp_dirs))
        time.sleep(0.2)


def _end_processes(temp_dirs: list[Path], netns: str, sessions: list[int]) -> None:
    """SIGKILL every process of ours and wait for them; look again for children started meanwhile."""
    for _ in range(3):
        procs = _ours(temp_dirs, netns, sessions)
        if not procs:
            return
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(procs, timeout=5)


def _ours(temp_dirs: list[Path], netns: str, sessions: list[int]) -> list[psutil.Process]:
    """Processes with our temp dir in their command line, in our netns or sessions, and their children."""
    pids = {int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split()}
    marks = [str(d) for d in temp_dirs]
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error, OSError):
            if any(m in " ".join(p.info["cmdline"] or ()) for m in marks) or os.getsid(p.pid) in sessions:
                pids.add(p.pid)
    procs = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            parent = psutil.Process(pid)
            procs.update({p.pid: p for p in [parent, *parent.children(recursive=True)]})
    procs.pop(os.getpid(), None)
    return [p for p in procs.values() if _running(p)]


def _running(p: psutil.Process) -> bool:
    """Alive and not a zombie: a zombie is dead already, and waiting on one that is not our child lasts the timeout."""
    with contextlib.suppress(psutil.Error):
        return p.status() != psutil.STATUS_ZOMBIE
    return False


def _log_tails(temp_dirs: list[Path], lines: int = 30) -> str:
    """The end of each `ray start` log and of the GCS and raylet logs, for error messages."""
    out = []
    for d in temp_dirs:
        logs = d / "session_latest" / "logs"
        for path in [d / "ray-start.log", logs / "gcs_server.out", logs / "raylet.out", logs / "raylet.err"]:
            if path.is_file():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"\n--- {path} (last {len(tail)} lines) ---\n" + "\n".join(tail))
    return "".join(out) or "\n(no Ray logs were written)"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)
