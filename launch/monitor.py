"""What the driver shows and records: evaluation, TensorBoard scalars, progress lines."""

from __future__ import annotations

import time

from launch.config import Config


def eval_tasks(cfg: Config, seed: int | None = None, episodes: int | None = None) -> list[dict]:
    """The fixed evaluation set of --env (maze-64 by default): --eval-episodes tasks from the
    environment's evaluation seed, unless `seed` and `episodes` say otherwise."""
    from envs import make_env

    env = make_env(cfg.env, **cfg.env_kwargs())
    try:
        return env.eval_tasks(env.eval_seed if seed is None else seed, episodes or cfg.eval_episodes)
    finally:
        env.close()


class Evaluator:
    """Greedy success on the environment's fixed evaluation set (maze-64 by default).

    Usage::

        ev = Evaluator(cfg, model_path)
        ev.evaluate()                       # the policy as loaded (version 0)
        ev.load(adapter.version, adapter.tensors); ev.evaluate()
    """

    def __init__(self, cfg: Config, model_path: str, seed: int | None = None, episodes: int | None = None) -> None:
        from actors.engines import make_engine
        from envs import make_env

        self.cfg = cfg
        kwargs = cfg.env_kwargs()
        self.make_env = lambda: make_env(cfg.env, **kwargs)
        self.tasks = eval_tasks(cfg, seed, episodes)
        self.engine = make_engine(cfg.actor.engine, model_path, cfg.learner.lora, device=cfg.actor.engine_device,
                                  **cfg.actor.engine_options())
        self.chat = cfg.chat(model_path)

    @property
    def version(self) -> int:
        return self.engine.version

    def load(self, version: int, tensors: dict) -> None:
        self.engine.load_adapter(version, tensors)

    def close(self) -> None:
        """Release the engine (vLLM's stops its processes)."""
        self.engine.close()

    def evaluate(self, temperature: float = 0.0, samples: int = 1) -> dict[str, float]:
        """Greedy success by default; `temperature`, `samples`: see `actors.rollout.evaluate`."""
        from actors.rollout import evaluate

        return evaluate(self.engine, self.chat, self.make_env, self.tasks, self.cfg.actor.max_new_tokens,
                        self.cfg.actor.max_tokens, temperature=temperature, samples=samples)


class Board:
    """TensorBoard scalars plus a progress line on stdout; every scalar and text goes to each of
    `sinks` too (launch/sinks.py: W&B, MLflow), under the same name and step."""

    def __init__(self, logdir: str, steps: int, sinks: list | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(logdir)
        self.sinks = list(sinks or [])
        self.steps = steps
        self.t0 = time.time()
        self.last: dict[str, float] = {}
        self.evals: list[tuple[int, float]] = []
        self.step = 0
        """The learners' optimizer steps so far (the x axis is the policy version)."""

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Written and flushed: a driver that is killed loses none of the steps it logged."""
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
            self.last[k] = v
        self.writer.flush()
        for sink in self.sinks:
            sink.scalars(step, values)

    def text(self, step: int, tag: str, rows: list[dict]) -> None:
        """Rows of text (sample episodes) at `step`: a markdown table in TensorBoard's text tab."""
        if not rows:
            return
        cells = [" | ".join(str(v).replace("|", "\\|").replace("\n", "<br>") for v in row.values()) for row in rows]
        table = "\n".join([" | ".join(rows[0]), " | ".join("---" for _ in rows[0]), *cells])
        self.writer.add_text(tag, table, step)
        self.writer.flush()
        for sink in self.sinks:
            sink.text(step, tag, rows)

    def histogram(self, step: int, tag: str, counts: dict[str, int]) -> None:
        """A histogram from {value: count} (e.g. staleness of served groups)."""
        import numpy as np

        if counts:
            values = np.repeat([float(k) for k in counts], [int(v) for v in counts.values()])
            self.writer.add_histogram(tag, values, step)

    def eval(self, version: int, result: dict[str, float]) -> None:
        self.scalars(version, {f"eval/{k}": v for k, v in result.items()})
        self.evals.append((version, result["success_rate"]))
        print(f"[{self._clock()}] eval v{version}: success {result['success_rate']:.1%} "
              f"(mean turns {result['turns_mean']:.1f})", flush=True)

    def _clock(self) -> str:
        s = int(time.time() - self.t0)
        return f"{s // 60:02d}:{s % 60:02d}"

    def note(self, text: str) -> None:
        """A line on stdout with the run's clock (what the driver is doing)."""
        print(f"[{self._clock()}] {text}", flush=True)

    def progress(self, version: int, groups_in: int | None = None, dropped: int = 0) -> None:
        """The progress line; `groups_in`, the groups replay has received so far, shows that
        rollouts arrive before the first learner step (the other figures come with a step), and
        `dropped`, the groups of equal rewards it dropped, what the dynamic sampling costs."""
        g = self.last.get
        ev = f"{self.evals[-1][1]:.0%}@v{self.evals[-1][0]}" if self.evals else "-"
        at = f" (v{version})" if version != self.step else ""
        received = f" | groups in {groups_in}" if groups_in is not None else ""
        received += f" (+{dropped} equal, dropped)" if groups_in is not None and dropped else ""
        print(f"[{self._clock()}] step {self.step}/{self.steps}{at} | eval {ev}{received} | "
              f"reward {g('rollout/reward_mean', 0):.2f} | traj/s {g('perf/trajectories_per_s', 0):.1f} | "
              f"staleness {g('async/staleness_mean', 0):.2f} | learner idle {g('perf/learner_idle_fraction', 0):.0%} | "
              f"loss {g('learner/loss', 0):+.4f}", flush=True)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
        for sink in self.sinks:
            sink.close()


def step_scalars(m: dict) -> dict[str, float]:
    """TensorBoard names for one learner step's metrics."""
    out = {
        "learner/loss": m["loss"], "learner/grad_norm": m["grad_norm"],
        "learner/clip_fraction": m["clip_fraction"], "learner/behaviour_clip_fraction": m["behaviour_clip_fraction"],
        "learner/is_weight_mean": m["is_weight_mean"],
        "learner/is_weight_max": m["is_weight_max"], "learner/mismatch_kl": m["mismatch_kl"],
        "learner/entropy": m["entropy"], "learner/masked_fraction": m["masked_fraction"],
        "learner/policy_loss": m["policy_loss"], "learner/trained_fraction": m["trained_fraction"],
        "learner/lr": m["lr"],
        "rollout/reward_mean": m["reward_mean"], "rollout/seq_len_mean": m["seq_len_mean"],
        "async/staleness_mean": m["staleness_mean"], "async/staleness_max": m["staleness_max"],
        "perf/learner_idle_fraction": m["idle_fraction"], "perf/learner_train_s": m["train_s"],
        "perf/learner_wait_s": m["wait_s"], "perf/adapter_bytes": m["adapter_bytes"],
    }
    optional = {"kl_ref": "learner/kl_ref", "value_loss": "critic/value_loss",
                "explained_variance": "critic/explained_variance", "value_clip_fraction": "critic/clip_fraction",
                "critic_grad_norm": "critic/grad_norm", "checkpoint_s": "perf/checkpoint_s",
                "step_share": "learner/step_share"}
    out.update({tag: m[k] for k, tag in optional.items() if k in m})
    if "generate_s" in m:  # colocated mode: the ranks take turns generating and training
        total = m["generate_s"] + m["wait_s"] + m["train_s"] + m["publish_s"]
        out.update({"colocate/generate_s": m["generate_s"], "colocate/generate_share": m["generate_s"] / total,
                    "colocate/train_share": m["train_s"] / total})
    return out


FINISH_REASONS = ("terminated", "truncated", "length", "env_error")


def actor_scalars(stats: list[dict]) -> dict[str, float]:
    """TensorBoard names for the actors' counters, summed over actors: episodes by finish
    reason (env_error: the environment raised or ran past --actor.env-timeout-s); groups pushed,
    those whose rewards differed (mixed) and those that revisited a task (--actor.revisit)."""
    out = {f"rollout/finished_{r}": float(sum(s.get(f"finish/{r}", 0) for s in stats)) for r in FINISH_REASONS}
    out["rollout/env_errors"] = out["rollout/finished_env_error"]
    out["rollout/env_calls_abandoned"] = float(sum(s.get("env_abandoned", 0) for s in stats))
    for key in ("groups", "groups_mixed", "groups_revisited"):  # --actor.revisit's effect: mixed / groups
        out[f"rollout/{key}"] = float(sum(s.get(key, 0) for s in stats))
    return out


def replay_scalars(stats: dict) -> dict[str, float]:
    """TensorBoard names for the replay service's counters."""
    out = {
        "replay/queue_groups": stats["queue_groups"], "replay/stored_mb": stats["stored_bytes"] / 1e6,
        "replay/groups_in": stats["received_groups"], "replay/groups_out": stats["served_groups"],
        "replay/mb_in": stats["received_bytes"] / 1e6, "replay/mb_out": stats["served_bytes"] / 1e6,
        "replay/duplicates": stats["duplicates"], "replay/malformed_frames": stats["malformed_frames"],
        "replay/credit_wait_s": stats["credit_wait_s"], "replay/in_flight": stats["in_flight"],
        "replay/groups_in_shared_memory": stats["received_shared"],
        "replay/groups_in_socket": stats["received_groups"] - stats["received_shared"],
        "replay/log_pending": stats["pending"],
        "replay/credits_expired": stats["credits_expired"],
        "replay/kept_equal": stats["kept_equal"],
    }
    for reason in ("stale", "zero_variance"):
        out[f"replay/dropped_{reason}"] = stats["dropped"].get(reason, 0)
    return out


class InfoMeans:
    """The mean of each numeric `info` key the environments returned, over the episodes finished
    since the last call: `env/<key>` scalars from the actors' cumulative `info_sum/` and `info_n/`
    counters (actors/actor.py); with --actor.greedy-play also `rollout/greedy_outcome`, what the
    greedy plays achieved (their environments' rewards summed) on the tasks played since the last
    call: the greedy policy's score on fresh training tasks, beside evaluation's on its fixed set;
    with --actor.novelty also `rollout/novelty`, the mean exploration bonus an episode earned."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[float, float]] = {}

    def scalars(self, stats: list[dict]) -> dict[str, float]:
        totals: dict[str, list[float]] = {}  # tag -> [sum, count] over the actors

        def add(tag: str, total, n) -> None:
            acc = totals.setdefault(tag, [0.0, 0.0])
            acc[0] += float(total)
            acc[1] += float(n)

        for s in stats:
            for k, v in s.items():
                if k.startswith("info_sum/"):
                    key = k[len("info_sum/"):]
                    add(f"env/{key}", v, s.get(f"info_n/{key}", 0))
            if s.get("greedy_plays"):
                add("rollout/greedy_outcome", s.get("greedy_outcome_sum", 0.0), s["greedy_plays"])
            if "novelty_sum" in s:
                add("rollout/novelty", s["novelty_sum"], s.get("trajectories", 0))
        out = {}
        for tag, (total, n) in totals.items():
            before_total, before_n = self.seen.get(tag, (0.0, 0.0))
            if n < before_n:  # a restarted actor's counters went back: start again from here
                before_total, before_n = 0.0, 0.0
            if n > before_n:
                out[tag] = (total - before_total) / (n - before_n)
            self.seen[tag] = (total, n)
        return out


def sample_rows(stats: list[dict]) -> list[dict]:
    """The sample episodes of the first actor that has some, as rows (actor, version, task,
    reward, finish reason, text)."""
    for s in stats:
        sample = s.get("sample")
        if sample:
            return [{"actor": sample["actor"], "version": sample["version"], "task": sample["task"],
                     "reward": round(float(e["reward"]), 4), "finish_reason": e["finish_reason"], "text": e["text"]}
                    for e in sample["episodes"]]
    return []
