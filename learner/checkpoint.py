"""The learner group's checkpoints: what a run needs to go on after a fault, in its run directory.

    <run dir>/checkpoints/
      step-000020/              one checkpoint, renamed from step-000020.tmp once complete
        state/                  torch.distributed.checkpoint: the trainable parameters (policy
                                LoRA, PPO's critic LoRA and value head) and AdamW's state,
                                sharded as the ranks hold them (a checkpoint of N ranks loads on M)
        adapter/                the policy adapter in PEFT format (policy/adapter.py): usable
                                alone by launch.eval, PEFT or vLLM
        rng-<rank>.pt           each rank's torch RNG state
        meta.json               {"step", "version", "horizon", "world", "algo", "time"}
      published                 the highest policy version ever published (rank 0 rewrites it at
                                every publish, atomically)
    <run dir>/trained/rank-<r>.jsonl
                                one line per step and rank: {"version", "step", "groups": [ids]},
                                appended once replay has recorded the shard as trained on

Steps and versions. `step` counts the optimizer steps in the weights (the budget and the
learning-rate schedule go by it); `version` numbers the adapters published. They are equal
until a fault: a learner group that goes back to a checkpoint of step s loses the steps after it
(their data was trained on and is not served again), while versions published since then were
seen by actors and TensorBoard. So the group resumes at step s and publishes the checkpoint's
adapter as a new version, one above the highest ever published or recorded as trained
(`highest_version`): versions only go up, and no number ever names two different adapters.

Usage (every rank)::

    ckpt = Checkpoints(run_dir, keep=3)
    path = ckpt.latest()                  # None before the first one
    ckpt.save(learner)                    # collective: every rank calls
    ckpt.load(learner, path)              # collective, after the learner's setup
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

_NAME = re.compile(r"^step-(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit this run."""


class Checkpoints:
    def __init__(self, run_dir: str | os.PathLike, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"--keep-checkpoints must be at least 1, got {keep}")
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / "checkpoints"
        self.keep = keep

    # -- what is there ------------------------------------------------------------
    def all(self) -> list[Path]:
        """Complete checkpoints, oldest first (an unfinished `.tmp` is not one)."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        done = self.all()
        return done[-1] if done else None

    def published(self) -> int:
        """The highest policy version this run has published (0 before any)."""
        try:
            return int((self.root / "published").read_text().strip() or 0)
        except FileNotFoundError:
            return 0
        except ValueError as exc:
            raise CheckpointError(f"{self.root / 'published'} is not a version number: {exc}") from None

    def record_published(self, version: int) -> None:
        """Rank 0, after each publish: the run's highest version, written atomically."""
        self.root.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.root / "published", f"{version}\n")

    def highest_version(self) -> int:
        """The highest version this run has named: published, or recorded as made by a trained
        step (a step is recorded before its adapter is published, so a run killed between the
        two has a version in its trained records that it never published; it is not reused)."""
        highest = self.published()
        for path in (self.run_dir / "trained").glob("rank-*.jsonl"):
            for line in path.read_text().splitlines():
                try:
                    highest = max(highest, int(json.loads(line)["version"]))
                except (ValueError, KeyError, TypeError):
                    continue  # a line torn by the kill: its step was not recorded
        return highest

    def record_trained(self, rank: int, step: int, version: int, group_ids: list[str]) -> None:
        """Which groups rank `rank` trained on at `step` (the adapter it made is `version`)."""
        path = self.run_dir / "trained" / f"rank-{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({"version": version, "step": step, "groups": group_ids}) + "\n")

    @staticmethod
    def meta(path: Path) -> dict:
        try:
            return json.loads((path / "meta.json").read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {path} has no readable meta.json: {exc}") from None

    # -- writing and reading (collectives) -------------------------------------------
    def save(self, learner) -> Path:
        """Write the learner group's state as checkpoint `step-<step>`; every rank must call.
        Complete or absent: the files go into a `.tmp` directory that rank 0 renames once every
        rank has written its part. Older checkpoints beyond `keep` are removed."""
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        final = self.root / f"step-{learner.steps_done:06d}"
        tmp = final.with_name(final.name + ".tmp")
        if learner.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        model_state, optim_state = learner.state_dicts()
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp / "state"))
        torch.save({"torch": torch.get_rng_state()}, tmp / f"rng-{learner.rank}.pt")
        tensors = learner.adapter_tensors()  # collective
        if learner.rank == 0:
            from policy.adapter import write_adapter

            write_adapter(tmp / "adapter", tensors, learner.cfg.lora, learner.model_path, learner.version)
            _write_atomic(tmp / "meta.json", json.dumps({
                "step": learner.steps_done, "version": learner.version, "horizon": learner.horizon,
                "world": learner.world, "algo": learner.algo, "time": time.time()}, indent=2) + "\n")
        dist.barrier()  # every rank's files are in place
        if learner.rank == 0:
            missing = [r for r in range(learner.world) if not (tmp / f"rng-{r}.pt").is_file()]
            if missing:  # the ranks wrote into different filesystems
                raise CheckpointError(
                    f"checkpoint {tmp}: the files of rank(s) {missing} are not there. Learner ranks on several "
                    "machines need a run directory they all share (--logdir on NFS or another shared filesystem)")
            _fsync_tree(tmp)
            if final.exists():  # the same step again (a resumed run that saved it before its fault)
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            for old in self.all()[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return final

    def load(self, learner, path: Path) -> dict:
        """Put checkpoint `path` into the learner group (after its setup); every rank must call.
        Returns its meta. The versions: see the module docstring."""
        import torch
        import torch.distributed.checkpoint as dcp

        meta = self.meta(path)
        if meta.get("algo") != learner.algo:
            raise CheckpointError(f"checkpoint {path} was trained with --algo {meta.get('algo')}, "
                                  f"this run uses --algo {learner.algo}")
        model_state, optim_state = learner.state_dicts()
        state = {"model": model_state, "optim": optim_state}
        try:
            dcp.load(state, checkpoint_id=str(path / "state"))
        except Exception as exc:  # DCP raises several kinds; the message is what matters
            raise CheckpointError(f"cannot load checkpoint {path}: {exc}") from exc
        learner.load_state_dicts(state["model"], state["optim"])
        rng = path / f"rng-{learner.rank}.pt"
        if rng.is_file():  # absent when the group had fewer ranks then
            torch.set_rng_state(torch.load(rng, weights_only=True)["torch"])
        return meta


def resume_version(saved: int, published: int) -> int:
    """The version a learner group resumed from a checkpoint of version `saved` publishes its
    adapter as, when the run has published up to `published`: the same number when nothing was
    published after the checkpoint, else a new one above every published version."""
    return saved if published <= saved else published + 1


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
