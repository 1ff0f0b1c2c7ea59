"""The weight channel's same-host path: actors beside the learner read each adapter from a
shared-memory file instead of the socket, and fall back to the socket whenever that cannot be."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from policy.adapter import Adapter
from weights.publisher import WeightPublisher
from weights.shm import SHM_DIR, ShmWriter, read_shm
from weights.subscriber import WeightSubscriber

KEY = bytes(range(32))


def lora(seed: int, rows: int = 300) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.q_proj.lora_{ab}.weight": torch.randn(rows + i, 1000, generator=gen)
            for i in range(3) for ab in "AB"}


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def mapped(name: str) -> bool:
    return name in Path("/proc/self/maps").read_text()


def connect(publisher, subs) -> None:
    """Publish version 0 until every subscriber has it (their SUB sockets are connected)."""
    for _ in range(400):
        publisher.publish(Adapter(0, "base", {}, lora(0, rows=2)))
        if all(s.wait(0.05) is not None or s.version == 0 for s in subs):
            return
    raise AssertionError("the subscribers never received anything")


def test_subscribers_beside_the_publisher_read_adapters_from_shared_memory(closing):
    publisher = WeightPublisher(key=KEY)
    subs = [WeightSubscriber(publisher.endpoints, key=KEY) for _ in range(2)]
    closing(publisher)
    for s in subs:
        closing(s)
    connect(publisher, subs)
    assert all(s.local for s in subs)  # from then on, chunks no longer cross the socket to them
    for version in range(1, 5):
        tensors = lora(version)
        publisher.publish(Adapter(version, "base", {"r": 8}, tensors))
        name = publisher.shm.files[-1].name
        for s in subs:
            adapter = s.wait(20)
            assert adapter is not None and (adapter.version, adapter.config) == (version, {"r": 8})
            assert_same(adapter.tensors, tensors)
            assert mapped(name)  # views of the file, not bytes from the socket
            assert s.rejected == 0
    kept = [p.name for p in publisher.shm.files]
    assert len(kept) == 2 and all((Path(SHM_DIR) / n).exists() for n in kept)  # the newest two versions
    late = WeightSubscriber(publisher.endpoints, key=KEY)  # a restarted actor asks `latest`, as ever
    closing(late)
    assert_same(late.latest(timeout=20).tensors, tensors)
    publisher.close()
    assert not any((Path(SHM_DIR) / n).exists() for n in kept)


def test_a_subscriber_on_another_host_takes_the_chunks(closing):
    """Hosts as the launcher names them (Ray nodes: two on one machine are two hosts)."""
    publisher = WeightPublisher(key=KEY, host_key="ray-node:a")
    there = WeightSubscriber(publisher.endpoints, key=KEY, host_key="ray-node:b")
    here = WeightSubscriber(publisher.endpoints, key=KEY, host_key="ray-node:a")
    closing(publisher), closing(there), closing(here)
    connect(publisher, [there, here])
    tensors = lora(1)
    publisher.publish(Adapter(1, "base", {}, tensors))
    for sub in (there, here):
        adapter = sub.wait(20)
        assert adapter is not None and adapter.version == 1
        assert_same(adapter.tensors, tensors)
    assert here.local and not there.local


def test_when_shared_memory_cannot_be_written_the_version_comes_over_the_socket(closing, tmp_path, caplog):
    publisher = WeightPublisher(key=KEY)
    sub = WeightSubscriber(publisher.endpoints, key=KEY)
    closing(publisher), closing(sub)
    connect(publisher, [sub])
    assert sub.local
    publisher.shm.dir = tmp_path / "full"  # writing there fails, as into a /dev/shm without room
    tensors = lora(2)
    with caplog.at_level(logging.WARNING, logger="tandem.weights"):
        publisher.publish(Adapter(2, "base", {}, tensors))
    assert "over the socket from now on" in caplog.text and publisher.shm.off
    with caplog.at_level(logging.WARNING, logger="tandem.weights"):
        adapter = sub.wait(20)  # no announcement, then the commit: the subscriber asks `latest`
    assert adapter is not None and adapter.version == 2
    assert "version 2 is not in shared memory" in caplog.text  # and says so
    assert_same(adapter.tensors, tensors)
    publisher.publish(Adapter(3, "base", {}, lora(3)))
    assert sub.wait(20).version == 3


def test_files_left_by_dead_publishers_are_swept_and_others_kept():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = Path(SHM_DIR) / f"tandem-weights-{int(dead.stdout)}-{'0' * 16}"
    live = Path(SHM_DIR) / f"tandem-weights-{os.getppid()}-{'1' * 16}"
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    try:
        writer = ShmWriter()
        assert not stale.exists() and live.exists()
        writer.close()
    finally:
        stale.unlink(missing_ok=True)
        live.unlink(missing_ok=True)


def test_a_file_that_is_not_the_announced_one_is_refused(tmp_path):
    writer = ShmWriter(str(tmp_path))
    try:
        from weights.format import write_safetensors

        name = writer.write(write_safetensors(lora(1)))
        size = (tmp_path / name).stat().st_size
        assert_same(read_shm(name, size, str(tmp_path)), lora(1))
        with pytest.raises(ValueError, match="of ours of"):
            read_shm(name, size + 1, str(tmp_path))
        with pytest.raises(ValueError, match="not a weight file"):
            read_shm("../etc/passwd", 10, str(tmp_path))
        link = tmp_path / f"tandem-weights-1-{'2' * 16}"
        link.symlink_to(tmp_path / name)
        with pytest.raises(OSError):
            read_shm(link.name, size, str(tmp_path))
        (tmp_path / name).write_bytes(b"\xff" * size)
        with pytest.raises(ValueError, match="header length"):
            read_shm(name, size, str(tmp_path))
    finally:
        writer.close()
