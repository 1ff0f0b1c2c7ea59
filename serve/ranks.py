"""The Tinker service's learner ranks (`python -m launch.tinker --learners N`).

The service process is rank 0: it answers HTTP and leads. Ranks 1..N-1 are `python -m serve.ranks`
processes it starts on its host; each holds its FSDP shards of the base model (learner/model.py
`build_policy`, as the FSDP learner loads it: built on the meta device, filled from rank 0) and a
full copy of every training client's adapter and optimizer state (LoRA tensors are small; the
base model is what needs sharding). Every call that changes the model or runs it is led by rank
0: it checks the request (a caller's mistake is refused before any rank moves), sends the call
to the other ranks on a gloo group of its own (msgpack, arrays as raw bytes; nothing pickled),
then runs it itself. A forward_backward splits its datums between the ranks, every rank running
exactly one forward (a rank with no datum runs a one-token stand-in whose loss is zero), and
gathers the log-probs and the loss to rank 0; an optim_step sums the adapter's gradients over the
ranks first, so every rank takes the same step and the adapters stay equal.

A rank that fails leaves the group out of step: the others would wait in a collective. So a
follower that meets an error other than the caller's exits with its traceback, and the service
stops saying which rank failed and why (launch/tinker.py watches the processes); an error on rank 0
after a call was sent stops the service the same way (`Ranks.fail`).

Usage (rank 0)::

    ranks, procs = start_ranks(2, model_dir, threads=1)   # joins the group with the others
    trainer = Trainer(model_dir, ranks=ranks)              # every rank builds its shards
    ...
    trainer.close()                                        # the followers leave, the group ends
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import traceback
from dataclasses import dataclass
from typing import Callable

import msgpack

log = logging.getLogger("tandem.tinker")

JOIN_TIMEOUT_S = 600
"""How long a rank waits for the others to join, and a collective for its peers."""


@dataclass
class Ranks:
    """This process's place among the service's learner ranks."""

    rank: int
    world: int
    device: object
    """torch.device: cuda:<rank> where CUDA is available, else the CPU."""
    mesh: object
    """The FSDP device mesh over every rank."""
    control: object
    """The gloo group calls and gathered results travel on (the default group on CPU)."""
    on_failure: Callable[[str], None] | None = None
    """Rank 0: called with the reason when the ranks can no longer go on together."""

    @classmethod
    def join(cls, rank: int, world: int, init_url: str) -> "Ranks":
        """Join the process group of `world` ranks at `init_url` (every rank calls; blocks until all have)."""
        from datetime import timedelta

        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        cuda = torch.cuda.is_available()
        if cuda and torch.cuda.device_count() < world:
            raise RuntimeError(f"--learners {world}: this host has {torch.cuda.device_count()} GPUs; "
                               "the service's ranks take one GPU each")
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init_url, rank=rank, world_size=world,
                                timeout=timedelta(seconds=JOIN_TIMEOUT_S))
        control = dist.new_group(backend="gloo") if cuda else None
        return cls(rank, world, device, init_device_mesh(device.type, (world,)), control)

    # -- calls from rank 0 ------------------------------------------------------
    def lead(self, op: str, args: dict) -> None:
        """Rank 0: send call `op` with `args` (msgpack-able) to every other rank."""
        import torch
        import torch.distributed as dist

        payload = msgpack.packb({"op": op, "args": args}, use_bin_type=True)
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), src=0, group=self.control)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.control)

    def follow(self) -> tuple[str, dict]:
        """Ranks 1..N-1: the next call rank 0 sends, as (op, args)."""
        import torch
        import torch.distributed as dist

        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.control)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.control)
        call = msgpack.unpackb(payload.numpy().tobytes(), raw=False)
        return call["op"], call["args"]

    def sum(self, tensor):
        """`tensor` (on the CPU) summed over the ranks, in place; every rank gets the sum."""
        import torch.distributed as dist

        dist.all_reduce(tensor, group=self.control)
        return tensor

    def fail(self, reason: str) -> None:
        """Rank 0: the ranks are out of step (an error after a call was sent); the service must stop."""
        log.critical("learner ranks out of step: %s", reason)
        if self.on_failure is not None:
            self.on_failure(reason)

    def close(self, clean: bool) -> None:
        """Leave the group; after a clean end all ranks meet first."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        if clean:
            dist.barrier(group=self.control)
        dist.destroy_process_group()


# -- starting the ranks -------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(world: int, model_path: str, threads: int = 0) -> tuple[Ranks, list[subprocess.Popen]]:
    """Rank 0's side: start ranks 1..world-1 (`python -m serve.ranks`, their output beside this
    process's) and join the group with them."""
    url = f"tcp://127.0.0.1:{free_port()}"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, "-m", "serve.ranks", "--rank", str(r), "--world", str(world),
                               "--init", url, "--model", model_path, "--threads", str(threads)], env=env)
             for r in range(1, world)]
    try:
        return Ranks.join(0, world, url), procs
    except BaseException:
        for p in procs:
            p.kill()
        raise


def follow(trainer) -> None:
    """Ranks 1..N-1: run rank 0's calls until it says stop. A caller's mistake (UserError) is rank
    0's to answer, and it found the same; any other error ends this process with its traceback."""
    from serve.trainer import UserError

    while True:
        op, args = trainer.ranks.follow()
        if op == "stop":
            trainer.ranks.close(clean=True)
            return
        try:
            trainer.apply(op, args)
        except UserError:
            pass


def main(argv: list[str] | None = None) -> None:
    import argparse

    import torch

    from serve.trainer import Trainer

    parser = argparse.ArgumentParser(prog="python -m serve.ranks",
                                     description="One learner rank of the Tinker service (started by launch.tinker).")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--init", required=True, help="the process group's tcp:// address")
    parser.add_argument("--model", required=True, help="the served model's local directory")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {args.rank} %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        ranks = Ranks.join(args.rank, args.world, args.init)
        follow(Trainer(args.model, ranks=ranks))
    except Exception:  # noqa: BLE001 - the traceback goes to the service's log; the exit stops the service
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
