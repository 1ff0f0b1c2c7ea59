"""`python -m bench.weights`: the weight channel against bare ZeroMQ, in one run.

The learner publishes an adapter of an 8B model's shape (LoRA r = 32 on every linear layer of a
Qwen3-8B-sized decoder: 36 layers, hidden 4,096, MLP 12,288, 32 query and 8 KV heads of 128;
PEFT state-dict names, random values) through the weight channel, signed with a run key, to
several subscriber processes on this host. Time: from `publish` until every subscriber has the
whole adapter, checked, its tensors decoded. The channel runs twice: as it runs (subscribers
beside the publisher read each version from shared memory, weights/shm.py), and with
that path off (`transport="socket"`: the socket, as subscribers on other hosts get it, every chunk's
digest checked). The baseline sends the same bytes, in frames of the same size, through a bare
ZeroMQ PUB/SUB pair to the same number of processes, timed until every subscriber has received
them all. A second baseline does the same and hashes every byte once at each subscriber with
the channel's own hash (BLAKE3, keyed when signed): the least any channel that verifies what
crosses a socket with that hash must do.
The four paths run interleaved, `repeats` times; the table shows medians. Ends with one JSON
line: ratio (bare time / channel time), ratio_socket (bare time / the channel's socket path),
ratio_floor (hashed bare time / the socket path), sizes and times.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import tyro

from bench import TICK, ratio, sig


@dataclass
class Args:
    subscribers: int = 6
    """Subscriber processes (actors), on each path."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Wire dtype; the adapter is made in it (an 8B learner trains in bf16)."""
    rank: int = 32
    """LoRA rank."""
    layers: int = 36
    """Decoder layers (Qwen3-8B's shape by default)."""
    hidden: int = 4096
    """Hidden size: q_proj and o_proj are hidden × hidden."""
    intermediate: int = 12288
    """MLP size: gate_proj, up_proj hidden → intermediate, down_proj back."""
    heads: int = 32
    """Query heads."""
    kv_heads: int = 8
    """Key/value heads: k_proj and v_proj are hidden → kv_heads × head_dim."""
    head_dim: int = 128
    """Size of one attention head."""
    chunk_mib: int = 16
    """Chunk (frame) size of the channel, and of the baseline's frames."""
    repeats: int = 5
    """Runs of every path, interleaved; the table shows medians."""
    signed: bool = True
    """Sign the channel's frames with a run key, as a real run does."""


def lora_shapes(args: Args) -> dict[str, tuple[int, int]]:
    """PEFT state-dict names and shapes: lora_A [r, in], lora_B [out, r] for each linear layer."""
    q, kv = args.heads * args.head_dim, args.kv_heads * args.head_dim
    linear = {"self_attn.q_proj": (args.hidden, q), "self_attn.k_proj": (args.hidden, kv),
              "self_attn.v_proj": (args.hidden, kv), "self_attn.o_proj": (q, args.hidden),
              "mlp.gate_proj": (args.hidden, args.intermediate), "mlp.up_proj": (args.hidden, args.intermediate),
              "mlp.down_proj": (args.intermediate, args.hidden)}
    shapes = {}
    for i in range(args.layers):
        for module, (fan_in, fan_out) in linear.items():
            prefix = f"base_model.model.model.layers.{i}.{module}"
            shapes[f"{prefix}.lora_A.weight"] = (args.rank, fan_in)
            shapes[f"{prefix}.lora_B.weight"] = (fan_out, args.rank)
    return shapes


def _channel_sub(endpoints, key, expect, versions, ready, done) -> None:
    from weights.subscriber import WeightSubscriber

    sub = WeightSubscriber(endpoints, key=key)
    ready.put(os.getpid())
    seen = 0
    while seen < versions:
        adapter = sub.wait(120)
        if adapter is None:
            continue
        t = time.perf_counter()
        numel = sum(v.numel() for v in adapter.tensors.values())
        done.put((adapter.version, t, (len(adapter.tensors), numel) == expect, sub.local))
        seen += 1
        del adapter
    sub.close()


def _bare_sub(endpoint, size, versions, hashed, key, ready, done) -> None:
    import blake3
    import zmq

    mac_key = blake3.blake3(key, derive_key_context="tandem adapter chunk v1").digest() if key else None

    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    while sock.recv() != SYNC:  # connected: a PUB socket drops what is sent before
        continue
    ready.put(os.getpid())
    for version in range(versions):
        got, frames = 0, []
        while got < size:
            frame = sock.recv(copy=False)
            if len(frame) == len(SYNC) and frame.bytes == SYNC:
                continue  # sent while the others were connecting
            if hashed:
                (blake3.blake3(frame.buffer, key=mac_key) if mac_key else blake3.blake3(frame.buffer)).digest()
            frames.append(frame)
            got += len(frame)
        done.put((version, time.perf_counter(), got == size))
        del frames
    sock.close(0)


SYNC = b"sync"
"""What the baselines' PUB sockets send until every subscriber has connected."""


def _collect(done, n: int, version: int, t0: float, local: list | None = None) -> float:
    results = [done.get(timeout=300) for _ in range(n)]
    if local is not None:  # how many subscribers read it from shared memory
        local.append(sum(r[3] for r in results))
    assert all(r[0] == version and r[2] for r in results), f"a subscriber got the wrong thing: {results}"
    return max(r[1] for r in results) - t0


def main(args: Args) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import zmq

    from weights.format import to_safetensors
    from policy.adapter import Adapter
    from weights.publisher import WeightPublisher

    ctx = mp.get_context("spawn")
    shapes = lora_shapes(args)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    tensors = {k: (torch.randn(s, generator=gen) * 0.01).to(dtype) for k, s in shapes.items()}
    numel = sum(t.numel() for t in tensors.values())
    blob = to_safetensors(tensors)  # the bytes the baselines send: the channel's own serialisation
    size, chunk = len(blob), args.chunk_mib << 20
    versions = args.repeats + 1  # a warm-up round first on every path
    key = os.urandom(32) if args.signed else None

    publishers = {"channel": WeightPublisher(key=key, dtype=args.dtype, chunk_bytes=chunk),
                  "socket": WeightPublisher(key=key, dtype=args.dtype, chunk_bytes=chunk, transport="socket")}
    bare = zmq.Context.instance().socket(zmq.PUB)
    bare.setsockopt(zmq.SNDHWM, 1000)
    bare.bind("tcp://127.0.0.1:*")
    hashed = zmq.Context.instance().socket(zmq.PUB)
    hashed.setsockopt(zmq.SNDHWM, 1000)
    hashed.bind("tcp://127.0.0.1:*")
    paths = ("channel", "socket", "bare", "hashed")
    ready, done = {p: ctx.Queue() for p in paths}, {p: ctx.Queue() for p in paths}
    procs = [ctx.Process(target=_channel_sub, args=(pub.endpoints, key, (len(shapes), numel), versions,
                                                     ready[name], done[name]))
             for name, pub in publishers.items() for _ in range(args.subscribers)]
    for name, sock in (("bare", bare), ("hashed", hashed)):
        procs += [ctx.Process(target=_bare_sub, args=(sock.getsockopt_string(zmq.LAST_ENDPOINT), size, versions,
                                                       name == "hashed", key, ready[name], done[name]))
                  for _ in range(args.subscribers)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 300
        for name, q in ready.items():  # every subscriber connected: none misses a frame
            for _ in range(args.subscribers):
                while True:
                    for sock in (bare, hashed):
                        sock.send(SYNC)
                    try:
                        q.get(timeout=0.05)
                        break
                    except queue.Empty:
                        assert time.monotonic() < deadline, f"the {name} subscribers never started"

        def send_bare(sock, version: int) -> float:
            t0 = time.perf_counter()
            for off in range(0, size, chunk):
                sock.send(blob[off:off + chunk], copy=False)
            return _collect(done["bare" if sock is bare else "hashed"], args.subscribers, version, t0)

        def send_channel(name: str, version: int) -> tuple[float, float]:
            t0 = time.perf_counter()
            publishers[name].publish(Adapter(version, "Qwen/Qwen3-8B", {"r": args.rank, "lora_alpha": 2 * args.rank},
                                             tensors))
            published = time.perf_counter() - t0
            return _collect(done[name], args.subscribers, version, t0, local[name]), published

        times = {"bare": [], "hashed": [], "channel": [], "publish": [], "socket": [], "publish_socket": []}
        local = {"channel": [], "socket": []}
        for version in range(versions):
            runs = (send_bare(bare, version), send_bare(hashed, version), *send_channel("channel", version),
                    *send_channel("socket", version))
            if version:  # the first round is the warm-up
                for name, t in zip(times, runs):
                    times[name].append(t)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.terminate()
        for pub in publishers.values():
            pub.close()
        bare.close(0)
        hashed.close(0)

    med = {name: float(np.median(ts)) for name, ts in times.items()}
    print(f"adapter: LoRA r={args.rank} on every linear layer of a {args.layers}-layer, {args.hidden}-wide model: "
          f"{len(shapes)} tensors, {numel / 1e6:.1f}M parameters, {size / 1e6:.1f} MB in {args.dtype}, "
          f"{-(-size // chunk)} chunks of {args.chunk_mib} MiB; {args.subscribers} subscriber processes; "
          f"{'signed' if args.signed else 'unsigned'}; {os.cpu_count()} CPU cores; median of {args.repeats} runs")
    print(f"{'path':<50}{'seconds':>9}{'GB/s out':>10}   runs (s)")
    for label, name in (("bare ZeroMQ PUB/SUB", "bare"), ("bare + BLAKE3 of every byte at each subscriber", "hashed"),
                        ("weight channel (publish to all decoded)", "channel"), ("  of which publish()", "publish"),
                        ("weight channel, socket path (transport='socket')", "socket"),
                        ("  of which publish()", "publish_socket")):
        rate = size * args.subscribers / max(med[name], TICK) / 1e9 if not name.startswith("publish") else float("nan")
        print(f"{label:<50}{med[name]:>9.4g}{rate:>10.2f}   " + " ".join(f"{t:.4g}" for t in times[name]))
    result = {"subscribers": args.subscribers, "dtype": args.dtype, "adapter_bytes": size, "tensors": len(shapes),
              "chunk_mib": args.chunk_mib, "signed": args.signed, "channel_s": sig(med["channel"]),
              "publish_s": sig(med["publish"]), "socket_s": sig(med["socket"]),
              "bare_s": sig(med["bare"]), "bare_blake3_s": sig(med["hashed"]),
              "ratio": ratio(med["bare"], med["channel"]), "ratio_socket": ratio(med["bare"], med["socket"]),
              "ratio_floor": ratio(med["hashed"], med["socket"]),
              "subscribers_reading_shm": local["channel"][-1],
              "subscribers_reading_shm_socket_path": local["socket"][-1]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(tyro.cli(Args))
