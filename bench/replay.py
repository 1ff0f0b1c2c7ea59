"""`python -m bench.replay`: replay throughput against bare ZeroMQ, in one run.

Several actor processes push groups of 8 trajectories × 4,096 tokens (ids,
log-probs, mask, versions: ~416 KB a group) through the replay service while a
learner process samples batches, decodes every group and acknowledges each
step. The baseline sends frames of the same size through a bare ZeroMQ
PUSH/PULL pair from the same number of processes. Then the replay run again
with its durable log on. Prints a table and, last, one JSON line:
groups_per_s, raw_groups_per_s, ratio, ratio_durable.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass

import numpy as np
import tyro

from bench import ratio, sig


@dataclass
class Args:
    actors: int = 2
    """Pushing processes (the same number of PUSH sockets for the baseline)."""
    groups: int = 5000
    """Groups the learner consumes in each run."""
    group_size: int = 8
    """Trajectories per group."""
    tokens: int = 4096
    """Tokens per trajectory."""
    batch: int = 16
    """Groups per learner step."""
    fsync: str = "interval"
    """fsync policy of the durable run."""
    arena_mb: int = 128
    """Each actor's shared-memory arena (the same-host path; the socket runs use none): room for
    `window` groups and some."""
    capacity: int = 256
    """The replay's capacity in groups (--replay.capacity defaults to 1,024; smaller here, so that it binds)."""
    window: int = 128
    """Pushes each actor keeps awaiting acknowledgement. With the log, a push is acknowledged once
    a log write has it, so the pipeline must hold a few writes' worth of groups."""
    ahead: int = 64
    """Credits each actor asks for ahead of the groups it has started."""
    repeats: int = 3
    """Runs of every path, interleaved; the table shows medians."""


def make_group(args: Args, rng):
    from replay.wire import Group, Trajectory

    n = args.tokens
    trajs = [Trajectory(tokens=rng.integers(0, 150_000, n).astype(np.int32),
                        logprobs=-rng.random(n).astype(np.float32), mask=(rng.random(n) < 0.5).astype(np.uint8),
                        versions=np.zeros(n, np.int32), reward=float(i % 2), turns=4, finish_reason="terminated")
             for i in range(args.group_size)]
    return Group(uuid.uuid4().hex, "bench", trajs)


def _actor(args: Args, endpoint: str, name: str, stop, arena_mb: int) -> None:
    from replay.zmq_client import ZmqActorReplay

    client = ZmqActorReplay(endpoint, actor=name, arena_bytes=arena_mb << 20, window=args.window)
    client.hello()
    group = make_group(args, np.random.default_rng(0))
    for _ in range(args.ahead):  # groups started and not yet pushed
        client.request_credit()
    while not stop.is_set():
        for _ in client.credits(timeout=0.2):
            group.group_id = uuid.uuid4().hex
            client.send(group)
            client.request_credit()
    client.flush(timeout=30)
    client.close()


def _server(args: Args, log_dir, ready, stop) -> None:
    from replay.buffer import ReplayBuffer
    from replay.log import ReplayLog
    from replay.server import ReplayServer

    log = ReplayLog(log_dir, fsync=args.fsync) if log_dir else None
    server = ReplayServer(ReplayBuffer(args.batch, max_staleness=1 << 30, capacity_groups=args.capacity,
                                       log=log),
                          "tcp://127.0.0.1:*")
    ready.put(server.start())
    stop.wait()
    server.stop()


def run_replay(args: Args, durable: bool, shared: bool) -> tuple[float, float]:
    """(groups/s the learner consumed, fraction of groups that came through shared memory)."""
    ctx = mp.get_context("spawn")
    ready, stop, stop_actors = ctx.Queue(), ctx.Event(), ctx.Event()
    log_dir = tempfile.mkdtemp(prefix="tandem-bench-log-") if durable else None
    server = ctx.Process(target=_server, args=(args, log_dir, ready, stop))
    server.start()
    endpoint = ready.get(timeout=60)
    arena_mb = args.arena_mb if shared else 0
    actors = [ctx.Process(target=_actor, args=(args, endpoint, f"actor-{i}", stop_actors, arena_mb))
              for i in range(args.actors)]
    for p in actors:
        p.start()
    from replay.zmq_client import ZmqLearnerReplay

    learner = ZmqLearnerReplay(endpoint, arena_bytes=arena_mb << 20)
    steps = args.groups // args.batch
    warm = 5
    for step in range(steps + warm):
        if step == warm:
            t0 = time.perf_counter()
        groups = learner.sample(step, 0, step, timeout=120)
        assert len(groups) == args.batch
        learner.ack(step, 0, wait=False)  # as the trainer does
    elapsed = time.perf_counter() - t0
    stats = learner.stats()
    stop_actors.set()  # actors flush their last sends while the server still answers
    for p in actors:
        p.join(60)
    stop.set()
    server.join(30)
    if log_dir:
        shutil.rmtree(log_dir, ignore_errors=True)
    return steps * args.batch / elapsed, stats["received_shared"] / max(stats["received_groups"], 1)


def _pusher(args: Args, endpoint: str, stop) -> None:
    import zmq

    from replay.wire import encode_group, pack

    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(endpoint)
    frame = pack("push", id=1, group=encode_group(make_group(args, np.random.default_rng(0))))
    while not stop.is_set():
        try:
            sock.send(frame, flags=zmq.NOBLOCK)
        except zmq.Again:
            time.sleep(0.001)
    sock.close(0)


def run_raw(args: Args) -> float:
    import zmq

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.bind("tcp://127.0.0.1:*")
    endpoint = pull.getsockopt_string(zmq.LAST_ENDPOINT)
    pushers = [ctx.Process(target=_pusher, args=(args, endpoint, stop)) for _ in range(args.actors)]
    for p in pushers:
        p.start()
    for _ in range(5 * args.batch):
        pull.recv()
    t0 = time.perf_counter()
    for _ in range(args.groups):
        pull.recv()
    elapsed = time.perf_counter() - t0
    stop.set()
    while pull.poll(100):
        pull.recv()
    for p in pushers:
        p.join(30)
    pull.close(0)
    return args.groups / elapsed


def main(args: Args) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from replay.wire import encode_group

    size = len(encode_group(make_group(args, np.random.default_rng(0))))
    paths = [("replay, same host (shared memory)", False, True), ("replay + durable log, same host", True, True),
             ("replay, socket only", False, False), ("replay + durable log, socket only", True, False)]
    raws, rates = [], {name: [] for name, _, _ in paths}
    for _ in range(args.repeats):  # interleaved, so that a noisy minute hits every path alike
        raws.append(run_raw(args))
        for name, durable, shared in paths:
            rates[name].append(run_replay(args, durable, shared))
    raw = float(np.median(raws))
    median = {name: (float(np.median([r for r, _ in runs])), min(f for _, f in runs)) for name, runs in rates.items()}
    print(f"group: {args.group_size} trajectories x {args.tokens} tokens (~{size / 1024:.0f} KiB), "
          f"{args.actors} pushing processes (each {args.window} pushes awaiting acks, {args.ahead} credits ahead), "
          f"capacity {args.capacity}, {args.groups} groups per run, fsync={args.fsync} with the log; "
          f"median of {args.repeats} interleaved runs")
    print(f"{'path':<36}{'groups/s':>10}{'MB/s':>9}{'ratio':>8}{'via shm':>9}   runs (groups/s)")
    for name, (rate, shm) in [("bare ZeroMQ PUSH/PULL", (raw, 0.0)), *median.items()]:
        runs = raws if name.startswith("bare") else [r for r, _ in rates[name]]
        print(f"{name:<36}{rate:>10.0f}{rate * size / 1e6:>9.0f}{rate / raw:>8.2f}{shm:>9.0%}   "
              + " ".join(f"{r:.0f}" for r in runs))
    ours, durable, sock, sock_durable = (median[name][0] for name, _, _ in paths)
    result = {"groups_per_s": sig(ours), "raw_groups_per_s": sig(raw), "ratio": ratio(ours, raw),
              "groups_per_s_durable": sig(durable), "ratio_durable": ratio(durable, raw),
              "ratio_socket": ratio(sock, raw), "ratio_durable_socket": ratio(sock_durable, raw)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(tyro.cli(Args))
