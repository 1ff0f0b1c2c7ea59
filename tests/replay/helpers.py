"""Building real groups for replay tests (data, not stand-ins for our parts)."""

import os
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgpack
import numpy as np

from replay.wire import Group, Trajectory, encode_group, group_parts


def make_group(version: int = 0, size: int = 4, length: int = 40, rewards=None, seed: int = 0,
               actor: str = "actor-0") -> Group:
    rng = np.random.default_rng(seed)
    rewards = rewards if rewards is not None else [float(i % 2) for i in range(size)]
    trajs = []
    for r in rewards:
        mask = (np.arange(length) % 4 == 3).astype(np.uint8)
        trajs.append(Trajectory(
            tokens=rng.integers(4, 100, length).astype(np.int32),
            logprobs=np.where(mask, -rng.random(length) * 3, 0).astype(np.float32),
            mask=mask, versions=np.full(length, version, np.int32),
            reward=float(r), turns=3, finish_reason="terminated"))
    return Group(uuid.uuid4().hex, f"seed={seed}", trajs, actor=actor)


def with_turn_states(g: Group) -> Group:
    """`g` with each trajectory's three turns' states and rewards, as an actor records them."""
    for i, t in enumerate(g.trajectories):
        t.anchors, t.turn_rewards = [i, (1 << 63) - 1, 7], [0.0, -0.5, float(i)]
    return g


IMAGE_SHAPES = [[(17, 23), (64, 48), (1, 1)], [], [(5, 300)], [(32, 32), (32, 32)]]
"""Images per trajectory of `make_image_group`: different numbers and sizes, one with none."""


def make_image_group(seed: int = 0, shapes=IMAGE_SHAPES, **kwargs) -> Group:
    """A multi-turn group whose trajectories carry RGB images of `shapes` (one list each)."""
    g = make_group(size=len(shapes), seed=seed, **kwargs)
    rng = np.random.default_rng(seed + 1000)
    for t, traj_shapes in zip(g.trajectories, shapes):
        t.images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in traj_shapes]
    return g


def assert_same_images(a: Group, b: Group) -> None:
    """`b` carries `a`'s images exactly, as read-only uint8 [h, w, 3] arrays."""
    assert a.group_id == b.group_id and len(a.trajectories) == len(b.trajectories)
    for x, y in zip(a.trajectories, b.trajectories):
        assert len(x.images) == len(y.images)
        for i, j in zip(x.images, y.images):
            assert j.dtype == np.uint8 and j.shape == i.shape and not j.flags.writeable
            np.testing.assert_array_equal(i, j)


def frame(header: dict, payload: bytes) -> bytes:
    """A group blob laid out by hand as replay/wire.py describes it (magic, header length, msgpack
    header, zeros to an 8-byte boundary, payload), for blobs that `encode_group` would refuse."""
    head = msgpack.packb(header, use_bin_type=True)
    start = (8 + len(head) + 7) // 8 * 8
    return struct.pack("<4sI", b"TGRP", len(head)) + head + bytes(start - 8 - len(head)) + bytes(payload)


def corrupt(blob, mutate_header=None, mutate_payload=None) -> bytes:
    """`blob` with its header or payload changed."""
    header, payload = group_parts(blob)
    payload = bytearray(payload)
    if mutate_header:
        mutate_header(header)
    if mutate_payload:
        mutate_payload(payload)
    return frame(header, payload)


def bad_image_blobs() -> list[tuple[bytes, str]]:
    """(blob, what the WireError says) for each way an image group's header or payload can be wrong."""
    blob = bytes(encode_group(make_image_group()))

    def images(mutate):
        return lambda h: mutate(h["images"])

    return [
        (corrupt(blob, images(lambda s: s.pop())), "'images' has 3 entries for 4 trajectories"),
        (corrupt(blob, images(lambda s: s.append([]))), "'images' has 5 entries for 4 trajectories"),
        (corrupt(blob, images(lambda s: s[0].__setitem__(0, [0, 23]))), r">= 1 - at `\$.images\[0\]\[0\]"),
        (corrupt(blob, images(lambda s: s[0].__setitem__(0, [-17, 23]))), r"\$.images\[0\]\[0\]"),
        (corrupt(blob, images(lambda s: s[2].__setitem__(0, [4097, 1]))), r"<= 4096 - at `\$.images\[2\]\[0\]"),
        (corrupt(blob, images(lambda s: s[0].__setitem__(0, [17]))), r"length 2.* `\$.images\[0\]\[0\]"),
        (corrupt(blob, images(lambda s: s[0].__setitem__(0, [17, 23, 3]))), r"length 2.* `\$.images\[0\]\[0\]"),
        (corrupt(blob, images(lambda s: s[0].__setitem__(0, ["17", 23]))), r"\$.images\[0\]\[0\]\[0\]"),
        (corrupt(blob, images(lambda s: s[0].__setitem__(0, 17))), r"\$.images\[0\]\[0\]"),
        (corrupt(blob, lambda h: h.update(images={"0": [[1, 1]]})), r"\$.images"),
        (corrupt(blob, images(lambda s: s.__setitem__(1, [[1, 1]] * 1025))), r"<= 1024 - at `\$.images\[1\]"),
        (corrupt(blob, images(lambda s: s[0].__setitem__(0, [17, 24]))), "payload length"),
        (corrupt(blob, lambda h: h.pop("images")), "payload length"),
        (corrupt(blob, mutate_payload=lambda p: p.__delitem__(-1)), "payload length"),
        (corrupt(blob, mutate_payload=lambda p: p.append(0)), "payload length"),
    ]


def make_entry(**kwargs):
    """A group as the buffer stores it."""
    from replay.buffer import Entry

    g = make_group(**kwargs)
    return Entry.of(g, encode_group(g))


KEY = os.urandom(32)
"""The run key of the replay processes that `start_replay` starts."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replay(port: int, log_dir, fsync: str = "interval", groups_per_step: int = 2,
                 learners: int = 1) -> subprocess.Popen:
    """A replay service process (`python -m replay.server`) on `port`, keeping its log in `log_dir`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "replay.server", "--groups-per-step", str(groups_per_step),
         "--learners", str(learners), "--max-staleness", "1000",
         "--replay.port", str(port), "--replay.log-dir", str(log_dir), "--replay.fsync", fsync],
        env={**os.environ, "TANDEM_KEY": KEY.hex()}, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "replay serving" in line, line
    return proc


class ReplayProcess:
    """A replay service process on one port and log directory, to kill and start again."""

    def __init__(self, log_dir, **kwargs) -> None:
        self.port, self.log_dir, self.kwargs = free_port(), log_dir, kwargs
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.proc = start_replay(self.port, log_dir, **kwargs)

    def pause(self) -> None:
        """SIGSTOP it and wait until it is stopped: from here on it reads nothing."""
        self.proc.send_signal(signal.SIGSTOP)
        stat = Path(f"/proc/{self.proc.pid}/stat")
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.01)

    def restart(self) -> None:
        """SIGKILL it (if it runs), then start a new one."""
        self.stop()
        self.proc = start_replay(self.port, self.log_dir, **self.kwargs)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()

