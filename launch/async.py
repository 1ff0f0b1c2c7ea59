"""`python -m launch.async`: the main job.

Parses the root config, resolves the model once (a Hub id to its snapshot in the
Hugging Face cache; the maze warm start is built if it is not cached yet) and
checks its chat template, starts (or joins) Ray, checks the cluster has the GPUs
the parts ask for, places the replay service, the learner ranks and the actors
as Ray actors, evaluates (here, or as a part beside the actors when they have
GPUs) and logs to TensorBoard, and shuts everything down on completion or Ctrl-C.
Whatever the user must fix stops the job before Ray starts, with exit code 2.

(The module is named `async.py` after the mode; `async` is a keyword, so no
code imports it: what other entry points share with it lives in launch/parts.py,
and `python -m launch.async` runs it as usual.)
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import threading
import time

from launch.config import Config


def main(cfg: Config) -> int:
    from policy.compat import check_torchvision

    check_torchvision()  # before anything loads a model
    import ray
    import torch

    from launch import cluster
    from launch.fleet import Fleet, PartFailed, RestartsSpent, init_error
    from launch.monitor import Board
    from launch.parts import (ActorPart, LearnerPart, ReplayPart, actor_options, gpu_demand, learner_gpus,
                              learner_options, replay_options, resolve_policy)
    from launch.supervise import LearnerFailed, LearnerGroup, ReplayService
    from ray.exceptions import RayActorError

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    started = time.time()  # the --max-minutes budget includes the warm start
    try:  # before the run directory and Ray: a model that is not there, or whose chat template
        # cannot be rendered turn by turn, is the user's to fix (ModelNotFound is a ValueError)
        model_path = resolve_policy(cfg)
        cfg.chat(model_path)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logdir = cfg.run_dir
    os.makedirs(logdir, exist_ok=True)
    lock = _lock_run(logdir)
    if lock is None:
        print(f"error: another job is running in {logdir} (its driver holds {logdir}/.lock); "
              "stop it first, or give this one another --logdir", file=sys.stderr)
        return 2
    config_path = os.path.join(logdir, "config.json")  # the run directory says how it was started
    with open(config_path + ".tmp", "w") as f:
        f.write(cfg.to_json())
    os.replace(config_path + ".tmp", config_path)
    torch.set_num_threads(1)
    if cfg.colocate:
        mode = "colocated (η=0): each learner rank generates its share, then trains; --actors is ignored"
        if cfg.actor.engine == "vllm" and cfg.learner.gpus == 0:
            mode += " (vLLM's CPU build cannot sleep: each rank holds vLLM's copy of the base weights too)"
    else:
        mode = f"async (η={cfg.staleness_bound})"
    playing = (cfg.rank_actor if cfg.colocate else cfg.actor).concurrent_groups
    print(f"tandem: {0 if cfg.colocate else cfg.actors} actors, {cfg.learners} learners, {mode}, {cfg.steps} steps "
          f"of {cfg.groups_per_step} groups × {cfg.actor.group_size} ({playing} groups at once per "
          f"{'rank' if cfg.colocate else 'actor'}), env {cfg.env}, model {model_path}, logs in {logdir}", flush=True)

    env_vars = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error", **cluster.hf_env()}
    joining = bool(cfg.ray_address)
    runtime_env = cluster.runtime_env(env_vars, cfg.env, joining, cfg.dataset.reward if cfg.env == "dataset" else "")
    if joining:
        try:
            cluster.join(cfg.ray_address, runtime_env)
        except cluster.JoinError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    else:
        cluster.start_local(max(os.cpu_count() or 1, 1 + cfg.learners + cfg.actors), runtime_env)
    _catch_interrupts()  # after ray.init, which installs handlers of its own
    short = cluster.gpu_shortfall(gpu_demand(cfg), ray.cluster_resources().get("GPU", 0))
    if short:
        ray.shutdown()
        print(f"error: {short}", file=sys.stderr)
        return 2
    if joining:
        problems = cluster.problems_text(cluster.check_nodes(cfg.env, model_path))
        if problems:
            ray.shutdown()
            print(f"error: nodes of the cluster at {cfg.ray_address} cannot run this job:\n{problems}", file=sys.stderr)
            return 2
    try:
        from launch.sinks import make_sinks

        sinks = make_sinks(cfg.log, logdir, json.loads(cfg.to_json()))
    except Exception as exc:  # a W&B login or an MLflow server the user must fix
        ray.shutdown()
        print(f"error: --log: {exc!r}", file=sys.stderr)
        return 2
    board = Board(logdir, cfg.steps, sinks)
    try:
        Replay, Learner, Actor = (ray.remote(p) for p in (ReplayPart, LearnerPart, ActorPart))
        key = secrets.token_bytes(32) if cfg.replay.sign else None  # this run's frame-signing key
        group = cluster.placement(cfg.learners, learner_gpus(cfg))  # replay and the learners, packed together
        replay = ReplayService(lambda port: Replay.options(**replay_options(group)).remote(cfg, key, port),
                               cfg.replay.restarts, logged=cfg.replay_log_dir is not None)
        endpoint = replay.endpoint
        learners = LearnerGroup(lambda r: Learner.options(**learner_options(cfg, group, r)).remote(
            cfg, model_path, r, endpoint, key), cfg.learners, cfg.learner.restarts, resume=bool(cfg.resume))
        weights = learners.start()
        fleet = Fleet(lambda i: Actor.options(**actor_options(cfg)).remote(cfg, model_path, i, endpoint, weights, key),
                      0 if cfg.colocate else cfg.actors, cfg.actor.restarts)  # calls run() on each
        if joining:
            names = ["replay", *(f"learner-{r}" for r in range(cfg.learners)),
                     *(f"actor-{i}" for i in range(len(fleet.actors)))]
            rows = ray.get([p.where.remote() for p in (replay.handle, *learners.ranks, *fleet.actors)], timeout=600)
            print(cluster.table(list(zip(names, rows)), cluster.where()), flush=True)
        _monitor(cfg, model_path, board, replay, learners, weights, key, started, fleet)
        fleet.stop(timeout=120)
        if _STOPPING.is_set():
            print(f"stopped at step {board.step} of {cfg.steps}: continue with  {resume_command(cfg)}", flush=True)
            return 0
        evals = board.evals
        scores = f"{evals[0][1]:.1%} (v{evals[0][0]}) -> {evals[-1][1]:.1%} (v{evals[-1][0]})" if evals else "-"
        print(f"done: {board.step} steps in {time.time() - board.t0:.0f}s; {cfg.env} eval success {scores}; "
              f"adapter in {logdir}/adapter", flush=True)
        return 0
    except KeyboardInterrupt:
        print(f"interrupted: stopping every part (continue with  {resume_command(cfg)})", flush=True)
        return 130
    except PartFailed as exc:  # a part's constructor raised (a GPU it cannot use, a model it cannot load)
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except RayActorError as exc:
        if not exc.actor_init_failed:
            raise
        print(f"error: a part could not start: {init_error(exc)}", file=sys.stderr, flush=True)
        return 1
    except LearnerFailed as exc:  # a rank's own error: its remote traceback, then which rank and what
        print(f"{exc.cause}\nerror: {exc}", file=sys.stderr, flush=True)
        return 1
    except RestartsSpent as exc:  # an actor, the replay service or the learner group died too often
        print(restarts_spent(cfg, exc), file=sys.stderr, flush=True)
        return 1
    finally:
        board.close()
        ray.shutdown()


def _lock_run(logdir: str):
    """An exclusive lock on the run directory for this driver's lifetime (the kernel drops it when
    the process dies, however it dies), or None when another driver holds it: two jobs writing
    one run's checkpoints and log would corrupt both."""
    import fcntl

    f = open(os.path.join(logdir, ".lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def restarts_spent(cfg: Config, exc: BaseException) -> str:
    """What the driver prints when a part has died more often than its restarts allow."""
    return f"error: {exc}\ncontinue the run from its newest checkpoint with  {resume_command(cfg)}"


def resume_command(cfg: Config) -> str:
    """The command that continues this run."""
    import shlex

    return f"python -m launch.async --resume {shlex.quote(cfg.run_dir)}"


_INTERRUPTED = threading.Event()
_STOPPING = threading.Event()


def _catch_interrupts() -> None:
    """Ctrl-C raises KeyboardInterrupt and also sets a flag the monitor loop checks every
    second: a library call that swallows the exception cannot keep the job running. SIGTERM (a
    scheduler's preemption notice) stops the run cleanly: the learners run up to two more steps
    (all ranks stop after the same one) and checkpoint, and the job exits with the command that
    continues it."""
    def handler(signum, frame):
        _INTERRUPTED.set()
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, lambda signum, frame: _STOPPING.set())


def _monitor(cfg, model_path, board, replay, learners, weights, key, started, fleet) -> None:
    from launch import cluster
    from launch.monitor import InfoMeans, actor_scalars, replay_scalars, sample_rows, step_scalars
    from launch.evaluators import make_evaluator
    from learner.checkpoint import Checkpoints
    from policy.adapter import read_adapter
    from weights.subscriber import WeightSubscriber

    evaluator = make_evaluator(cfg, model_path, fleet)  # where the actors run the policy
    sub = WeightSubscriber(weights, key=key, host_key=cluster.host_key())
    if cfg.resume:  # what the run evaluated before is in TensorBoard already
        checkpoints = Checkpoints(cfg.run_dir)
        last_eval = version = checkpoints.published()
        latest = checkpoints.latest()
        board.step = int(checkpoints.meta(latest)["step"]) if latest is not None else 0
    else:  # the actors play meanwhile; the driver prints nothing else until it is done
        board.note(f"evaluating v0: up to {cfg.eval_episodes} {cfg.env} episodes, greedy")
        result = evaluator.evaluate()  # on an actor's engine, the version it holds (launch/evaluators.py)
        last_eval, version = evaluator.version, 0
        board.eval(last_eval, result)
    last_print, newest, limited = 0.0, None, False
    info, last_sample = InfoMeans(), None
    rate_t, rate_n = time.time(), 0
    try:
        while True:
            if _INTERRUPTED.is_set():
                raise KeyboardInterrupt
            time.sleep(0.5)
            # A part whose process died is restarted (the actor, the replay service, the learner
            # group from its newest checkpoint); one that raised stops the run with its message.
            for line in fleet.check() + replay.check() + learners.check():
                print(line, flush=True)
            finished = learners.done  # before the metrics are drained: the last step's are among them
            over = cfg.max_minutes and time.time() - started > 60 * cfg.max_minutes
            if (over or _STOPPING.is_set()) and not limited:
                # Ranks run in lockstep and the driver's view lags by at most a step: two
                # steps ahead is past every rank, so all of them stop after the same step.
                learners.limit(board.step + 2)
                why = f"time budget of {cfg.max_minutes:g} min spent" if over else "SIGTERM"
                print(f"{why}: stopping at step {board.step + 2}", flush=True)
                limited = True
            for m in learners.drain_metrics():
                version, board.step = m["version"], m["step"]
                stats = replay.snapshot()
                scalars = step_scalars(m)
                actor_stats = learners.actor_stats() if cfg.colocate else fleet.stats()
                scalars.update(actor_scalars(actor_stats))
                scalars.update(info.scalars(actor_stats))
                every = cfg.log.samples_every
                if every and (last_sample is None or version - last_sample >= every):
                    rows = sample_rows(actor_stats)
                    if rows:
                        board.text(version, "samples", rows)
                        last_sample = version
                scalars["actors/restarts"] = float(sum(fleet.restarts))
                scalars["learner/restarts"] = float(learners.restarts)
                scalars["replay/restarts"] = float(replay.restarts)
                scalars["learner/step"] = float(m["step"])
                if stats is not None:
                    now, n = time.time(), stats["received_trajectories"]
                    if now > rate_t and n >= rate_n:  # a restarted replay counts from zero
                        scalars["perf/trajectories_per_s"] = (n - rate_n) / (now - rate_t)
                    rate_t, rate_n = now, n
                    scalars.update(replay_scalars(stats))
                    board.histogram(version, "replay/staleness_served", stats["staleness_served"])
                board.scalars(version, scalars)
            if finished:
                learners.result()  # surface a learner's exception
                final = read_adapter(os.path.join(cfg.run_dir, "adapter"))
                if final.version != last_eval:
                    evaluator.load(final.version, final.tensors)
                    result = evaluator.evaluate()
                    board.eval(evaluator.version, result)
                board.progress(version)
                return
            newest = sub.poll() or newest
            if newest is not None and newest.version - last_eval >= cfg.eval_every:
                evaluator.load(newest.version, newest.tensors)
                result = evaluator.evaluate()
                last_eval = evaluator.version
                board.eval(last_eval, result)
            if time.time() - last_print > 10:
                stats = replay.snapshot()
                if stats is not None:
                    board.progress(version, stats["received_groups"], stats["dropped"].get("zero_variance", 0))
                else:
                    board.progress(version)
                last_print = time.time()
    finally:
        sub.close()
        evaluator.close()


def cli(argv: list[str] | None = None) -> int:
    from launch.config import resumed_config

    try:
        cfg = resumed_config(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:  # raised by __post_init__ or the resume check: a value the user must change
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return main(cfg)


if __name__ == "__main__":
    sys.exit(cli())
