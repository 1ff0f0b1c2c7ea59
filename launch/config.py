"""The one root config, parsed by tyro: headline knobs on top, one dataclass per part.

`python -m launch.async --help` lists every field with the docstring under it.
Validation happens in `__post_init__`, with messages that say what to change.
This module imports nothing heavy, so `--help` answers at once.
"""

from __future__ import annotations

import time
from typing import Literal
from dataclasses import dataclass, field

from actors.actor import ActorConfig
from launch.envconfig import (CalculatorConfig, CodeConfig, CountdownConfig, DatasetConfig, ImageMazeConfig,
                              MazeConfig, SkyrlConfig, SqlConfig)
from launch import scale
from launch.sinks import LogConfig
from learner.config import DEFAULT_ALGO, DEFAULT_CORRECTION, Algo, Correction, LearnerConfig
from policy.choices import check_choices
from replay.server import ReplayConfig

ENV_DEFAULTS: dict[str, dict] = {
    "code": {"actor": {"max_new_tokens": 256, "max_tokens": 2048}},
    "image-maze": {"actor": {"group_size": 16, "revisit": 0.5}, "replay": {"drop_zero_variance": True},
                   "learner": {"entropy_coef": 0.01}},
}
"""What an environment changes of the defaults, on the command line and under a --config file; a
flag given (or a key of the file) wins. --env code: a bash block is longer than a maze move, and a
repository's outputs fill a context. --env image-maze: groups of 16 (8 a step on the CPU: the
same 128 sequences) with the equal-reward groups dropped (--replay.drop-zero-variance, where it
applies: GRPO or RLOO in the asynchronous mode), half of an actor's groups on tasks whose rewards
differed before (--actor.revisit 0.5) and an entropy bonus of 0.01 (--learner.entropy-coef). Near
the image maze's plateau most groups of 8 are all solved and the policy's entropy collapses:
docs/vision.md measures 75-83% on image-maze-64 with the global defaults, 85-97% with the first
two (95% or more within 30 minutes in two runs of ten) and 89-98% with all four (in four runs of
twelve)."""


def drops_apply(algo: str, colocate: bool) -> bool:
    """Whether --replay.drop-zero-variance fits the run: group-relative advantages (not PPO's
    critic, which learns from every group), in the asynchronous mode (no replay to drop from with
    --colocate)."""
    return algo != "ppo" and not colocate


def env_defaults(env: str, algo: str, colocate: bool) -> dict:
    """ENV_DEFAULTS of `env` as nested sections, without dynamic sampling where it does not apply."""
    import copy

    out = copy.deepcopy(ENV_DEFAULTS.get(env, {}))
    if not drops_apply(algo, colocate):
        out.get("replay", {}).pop("drop_zero_variance", None)
    return {section: values for section, values in out.items() if values}


@dataclass
class Config:
    """Tandem: asynchronous actor–learner RL for language-model agents."""

    actors: int = 6
    """Actor processes (each owns an inference engine and a batch of environments)."""
    learners: int = 2
    """Learner processes: FSDP ranks (gloo on CPU, NCCL on GPU)."""
    colocate: bool = False
    """Colocated, strictly on-policy mode: each learner rank generates its share of every batch on
    its own devices, then trains on the batch; generation and training take turns, η is 0, and
    --actors is ignored (no actor processes run). The torch engine generates with the trainer's
    own weights (one copy of the model per rank); vLLM holds a second copy of the base weights,
    and on GPUs sleeps while the rank trains or stays awake beside it (--actor.sleep; set
    --actor.memory-fraction to what the learner leaves free)."""
    steps: int = 250
    """Optimizer-step budget: the run ends after this many learner steps."""
    max_minutes: float = 0.0
    """Wall-clock budget of the whole run, warm start included (0 = no limit): when it is spent the
    learners stop within two steps (all ranks after the same one), the final adapter is saved and evaluated."""
    logdir: str | None = None
    """The run directory: TensorBoard events, config.json, checkpoints, the replay log and the final
    adapter (default runs/<env>-<mode>-<time>)."""
    checkpoint_every: int = 10
    """Checkpoint the learners (adapter, optimizer, schedule, version, RNG) every this many steps,
    at the end and when the job is stopped; 0 = never (then --resume starts the weights afresh)."""
    keep_checkpoints: int = 3
    """Checkpoints kept in the run directory (older ones are removed)."""
    resume: str | None = None
    """Continue the run in this directory to its step budget: its config.json, newest checkpoint
    and replay log. Flags given beside it may change only what is safe to change mid-run
    (--actors, --steps, --max-minutes, --eval-every, --ray-address, --actor.restarts, ...)."""
    max_staleness: int = 1
    """Staleness bound η: no group trained on is more than η policy versions old (forced to 0 by --colocate)."""
    algo: Algo = DEFAULT_ALGO
    """Advantage estimator: "grpo" (group-normalised; --learner.no-normalize-std gives Dr.GRPO),
    "rloo" (leave-one-out baseline) or "ppo" (a critic with its own LoRA adapter, GAE)."""
    correction: Correction = DEFAULT_CORRECTION
    """Staleness / mismatch correction against the behaviour log-probs μ: "none" (PPO clipped
    around μ: the default; with one update a step, as the default run makes, π_old is π_θ detached
    and only "none" keeps a trust region), "tis" (token-level truncated IS, min(π_old/μ, C)),
    "seq-tis" (sequence-level), "geo-mask" (drop trajectories whose geometric-mean ratio is off),
    "decoupled" (AReaL's decoupled PPO)."""
    model: str = "auto"
    """Policy: "builtin:maze" (tiny model after the maze warm start, built locally on first use),
    "builtin:tiny" (untrained), "builtin:vlm" (tiny vision-language model after the image-maze warm
    start; GRPO trains LoRA on its language model, the vision tower frozen unless
    --learner.lora.vision-tower), "builtin:tiny-vlm" (untrained), a local Hugging Face checkpoint
    directory, or a Hub id (fetched once by the driver into the Hugging Face cache, or read from it
    when HF_HUB_OFFLINE is set). "auto" is builtin:maze for --env maze, builtin:vlm for --env
    image-maze and builtin:tiny for any other environment."""
    chat_template_kwargs: str = ""
    """A JSON object passed to the model's chat template at every rendering, e.g.
    '{"enable_thinking": false}' to turn Qwen3's thinking off (empty: the template's defaults)."""
    tool_format: Literal["auto", "hermes", "llama3-json"] = "auto"
    """How the model writes tool calls, for environments in tool-call mode (--calculator.tool-calls,
    --sql.tool-calls, a TextEnv that declares tools): "hermes" (<tool_call>{json}</tool_call>:
    Qwen2.5, Qwen3), "llama3-json" (a JSON object: Llama 3.1 to 3.3) or "auto" (read off the
    chat template)."""
    env: str = "maze"
    """Environment to train on: maze, image-maze (the maze as pictures), countdown, sql, calculator,
    dataset (prompts and a reward function: --dataset.path, --dataset.reward), code (shell
    commands in a sandbox), skyrl:<id> (a skyrl-gym environment, with --skyrl.tasks), or
    module:Class (a TextEnv of your own). Two change defaults of other flags, which a flag given
    overrides: code sets --actor.max-new-tokens 256 and --actor.max-tokens 2048; image-maze sets
    --actor.group-size 16 (so 8 groups a step on the CPU), --replay.drop-zero-variance (with
    GRPO or RLOO in the asynchronous mode), --actor.revisit 0.5 and --learner.entropy-coef 0.01."""
    seed: int = 0
    """Seed for task sampling, the engines' samplers and adapter initialisation."""
    ray_address: str | None = None
    """Ray cluster to join ("HEAD_ADDRESS:PORT", or "auto" on one of its nodes); default: start a
    Ray of this job's own on this machine (never a cluster that `ray start` or RAY_ADDRESS points at)."""
    eval_every: int = 10
    """Evaluate greedily on the fixed evaluation set every this many policy versions."""
    eval_episodes: int = 64
    """Size of the evaluation set (64 gives maze-64)."""
    config: str | None = None
    """A YAML or JSON file of settings in the shape of these flags (sections as nested mappings,
    e.g. examples/maze.yaml, or a run's config.json); flags given beside it override the file."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    maze: MazeConfig = field(default_factory=MazeConfig)
    image_maze: ImageMazeConfig = field(default_factory=ImageMazeConfig)
    countdown: CountdownConfig = field(default_factory=CountdownConfig)
    sql: SqlConfig = field(default_factory=SqlConfig)
    calculator: CalculatorConfig = field(default_factory=CalculatorConfig)
    code: CodeConfig = field(default_factory=CodeConfig)
    skyrl: SkyrlConfig = field(default_factory=SkyrlConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        check_choices(self)
        if self.actors < 1:
            raise ValueError(f"--actors must be at least 1, got {self.actors}")
        if self.learners < 1:
            raise ValueError(f"--learners must be at least 1, got {self.learners}")
        if self.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {self.steps}")
        if self.max_staleness < 0:
            raise ValueError(f"--max-staleness must be 0 or more, got {self.max_staleness}")
        self._check_template_kwargs()
        self._check_env()
        self.log.check()
        if self.model == "auto":
            self.model = {"maze": "builtin:maze", "image-maze": "builtin:vlm"}.get(self.env, "builtin:tiny")
        if self.max_minutes < 0:
            raise ValueError(f"--max-minutes must be 0 (no limit) or positive, got {self.max_minutes}")
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every must be 0 (never) or more, got {self.checkpoint_every}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"--keep-checkpoints must be at least 1, got {self.keep_checkpoints}")
        if self.eval_every < 1 or self.eval_episodes < 1:
            raise ValueError("--eval-every and --eval-episodes must be at least 1")
        if 0 < self.actor.max_lora_rank < self.learner.lora.rank:
            raise ValueError(f"--actor.max-lora-rank ({self.actor.max_lora_rank}) is below --learner.lora.rank "
                             f"({self.learner.lora.rank}): the engine could not load the adapters")
        if self.replay.drop_zero_variance and not drops_apply(self.algo, self.colocate):
            raise ValueError("--replay.drop-zero-variance is for group-relative advantages in the asynchronous mode: "
                             + ("PPO's critic learns from every group (use --algo grpo or rloo)" if self.algo == "ppo"
                                else "--colocate plays exactly each step's batch, with no replay service to drop from"))
        if self.learner.step_weight > 0 and self.algo == "ppo":
            raise ValueError("--learner.step-weight adds GiGPO's step-level advantage to a group-relative one "
                             "(--algo grpo or rloo); PPO's critic gives each turn its own credit already")
        if self.ray_address and not self.replay.sign:
            raise ValueError("--replay.no-sign with --ray-address: frames between nodes are always signed with the "
                             "run's key (drop --replay.no-sign)")
        if 0 < self.learner.gpus < 1 and self.learners > 1:
            raise ValueError(f"--learner.gpus {self.learner.gpus:g} with --learners {self.learners}: NCCL needs a GPU "
                             "of its own for each rank, and Ray may put two ranks' fractions on one; use "
                             "--learner.gpus 1 (a fraction suits a single rank sharing its GPU with actors)")
        if self.groups_per_step % self.learners:
            raise ValueError(
                f"--learner.groups-per-step ({self.groups_per_step}) must be a multiple of "
                f"--learners ({self.learners}): each rank trains on an equal shard of every batch")

    @property
    def groups_per_step(self) -> int:
        """B as the run trains it: --learner.groups-per-step, or scaled from the GPUs when 0 (launch/scale.py)."""
        if self.learner.groups_per_step:
            return self.learner.groups_per_step
        return scale.groups_per_step(self.actors, self.actor, self.learners, self.learner.num_gpus,
                                     self.max_staleness, self.colocate)

    @property
    def rank_actor(self) -> ActorConfig:
        """--colocate: the actor settings each learner rank plays its share with (launch/scale.py)."""
        return scale.rank_actor(self.actor, self.groups_per_step // self.learners, self.learner.num_gpus)

    @property
    def staleness_bound(self) -> int:
        """η actually enforced: 0 in colocated mode, which is strictly on-policy."""
        return 0 if self.colocate else self.max_staleness

    @property
    def listen_host(self) -> str:
        """What the parts' sockets listen on: --replay.host, else loopback for a local run and each
        node's own address ("node") when joining a cluster."""
        return self.replay.host or ("node" if self.ray_address else "127.0.0.1")

    @property
    def run_dir(self) -> str:
        if self.logdir is None:  # fixed once, on first use
            mode = "colocate" if self.colocate else "async"
            env = self.env.replace(":", "-").replace("/", "-")
            self.logdir = f"runs/{env}-{mode}-{time.strftime('%Y%m%d-%H%M%S')}"
        return self.logdir

    @property
    def replay_log_dir(self) -> str | None:
        """Where replay keeps its log: --replay.log-dir, else `replay-log` in the run directory
        while checkpoints are on (unless --replay.no-log)."""
        import os

        if self.replay.log_dir:
            return self.replay.log_dir
        if self.replay.log and self.checkpoint_every > 0:
            return os.path.join(self.run_dir, "replay-log")
        return None

    def _check_env(self) -> None:
        import json
        import os

        from envs import env_entry

        try:
            env_entry(self.env)
        except ValueError as exc:
            raise ValueError(f"--env: {exc}") from None
        if self.env == "dataset":
            self.dataset.check()
        if self.env == "code":
            self._check_code()
        if self.env.startswith("skyrl:"):
            if not self.skyrl.tasks:
                raise ValueError(f"--env {self.env} needs --skyrl.tasks: a JSONL or Parquet file of task rows")
            for flag, path in (("--skyrl.tasks", self.skyrl.tasks), ("--skyrl.eval-file", self.skyrl.eval_file)):
                if path and not os.path.isfile(path):
                    raise ValueError(f"{flag} {path!r}: no such file")
            try:
                json.loads(self.skyrl.env_config)
            except ValueError:
                raise ValueError(f"--skyrl.env-config must be JSON, got {self.skyrl.env_config!r}") from None

    def _check_code(self) -> None:
        """A step that runs a command and then grades must end before the actor gives up on it, and
        this machine must be able to sandbox (else one clear error now, never an unsandboxed run)."""
        code = self.code
        if code.command_s + code.grade_s + 2 > self.actor.env_timeout_s:
            raise ValueError(f"--code.command-s ({code.command_s:g}) + --code.grade-s ({code.grade_s:g}) + 2 s must "
                             f"fit in --actor.env-timeout-s ({self.actor.env_timeout_s:g}): the last turn runs a "
                             "command and then grades; raise --actor.env-timeout-s or lower the limits")
        from envs.code import shared_sandbox
        from envs.sandbox import SandboxConfig, SandboxUnavailable
        from envs.swebench import read_rows

        try:
            shared_sandbox(SandboxConfig(root=code.sandbox_root, rootfs=code.rootfs, ro_binds=tuple(code.ro_binds)))
            if code.tasks:
                read_rows(code.tasks, code.repos)
        except (SandboxUnavailable, ValueError) as exc:
            raise ValueError(f"--env code: {exc}") from None

    def to_json(self) -> str:
        """The whole config, as JSON: the launcher writes it into the run directory at start
        (`config.json`), so that a run directory says how it was started."""
        import dataclasses
        import json

        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Config:
        """The config `to_json` wrote, checked again as if given on the command line; ValueError
        for a field this version does not have."""
        import json

        return _build(cls, json.loads(text))

    def _check_template_kwargs(self) -> None:
        import json

        try:
            value = json.loads(self.chat_template_kwargs) if self.chat_template_kwargs else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"--chat-template-kwargs must be a JSON object such as '{{\"enable_thinking\": false}}', "
                             f"got {self.chat_template_kwargs!r} ({exc})") from None
        if not isinstance(value, dict):
            raise ValueError(f"--chat-template-kwargs must be a JSON object (name: value), got {self.chat_template_kwargs!r}")

    @property
    def template_kwargs(self) -> dict:
        """--chat-template-kwargs as a dict (checked in __post_init__)."""
        import json

        return json.loads(self.chat_template_kwargs) if self.chat_template_kwargs else {}

    def chat(self, model_path: str):
        """The run's chat rendering of `model_path`'s tokenizer (policy.Chat: ValueError for a template
        that cannot be rendered turn by turn)."""
        from policy.load import load_chat

        return load_chat(model_path, self.template_kwargs, tools=self.env_tools(), tool_format=self.tool_format)

    def env_tools(self) -> list[dict]:
        """The tools --env declares in tool-call mode (`Tool.schema()` of each; empty without)."""
        from envs import make_env

        section = self.env_kwargs()
        own = ":" in self.env and not self.env.startswith("skyrl:")
        if not (own or section.get("tool_calls")):
            return []  # the built-in environments declare tools only with --<env>.tool-calls
        env = make_env(self.env, **section)
        try:
            return [t.schema() for t in env.tools]
        finally:
            env.close()

    def env_kwargs(self) -> dict:
        """Constructor arguments of --env from its section (--maze.*, --sql.*, ...)."""
        name = "skyrl" if self.env.startswith("skyrl:") else self.env
        section = {"maze": self.maze, "image-maze": self.image_maze, "countdown": self.countdown, "sql": self.sql,
                   "calculator": self.calculator, "code": self.code, "skyrl": self.skyrl,
                   "dataset": self.dataset}.get(name)
        return section.kwargs() if section is not None else {}


PROG = "python -m launch.async"
"""How --help and tyro's errors name the command."""

RESUME_SAFE = ("actors", "steps", "max_minutes", "eval_every", "ray_address", "resume", "checkpoint_every",
               "keep_checkpoints", "actor.restarts", "actor.spread", "actor.threads", "learner.restarts",
               "learner.threads", "learner.fused_lora", "replay.restarts", "replay.port", "replay.host",
               "actor.gpus", "learner.gpus", "actor.sleep", "log.wandb", "log.mlflow", "log.samples_every")
"""What flags given with --resume may change: how many actors, budgets, placement (the GPUs each
part asks for too), restarts, threads, how the learner computes the same updates (fused LoRA) and
where the run logs. Anything else (the model, the algorithm, the batch, the
environment) would make the rest of the run another experiment."""


def resumed_config(argv: list[str]) -> Config:
    """The config of a command line: the flags over --env's own defaults (ENV_DEFAULTS); with `--config
    FILE`, the file's settings between the two (launch/configfile.py); with `--resume DIR`, DIR's
    config.json with the flags given beside it applied. ValueError for a flag that may not change
    (RESUME_SAFE), a directory that holds no run, or a file that does not parse."""
    import os

    import tyro

    run_dir, file = _flag_value(argv, "--resume"), _flag_value(argv, "--config")
    if run_dir is not None and file is not None:
        raise ValueError("--config starts a new run and --resume continues one: give one of them")
    if run_dir is None:
        return _new_run_config(argv, file)
    path = os.path.join(run_dir, "config.json")
    try:
        with open(path) as f:
            base = Config.from_json(f.read())
    except FileNotFoundError:
        raise ValueError(f"--resume {run_dir}: no config.json there (is it the directory of a run?)") from None
    base.logdir, base.resume = run_dir, run_dir
    base.learner.groups_per_step = base.groups_per_step  # the batch the run started with, whatever --actors says now
    cfg = tyro.cli(Config, args=argv, default=base, prog=PROG)
    before, after = _flat(base), _flat(cfg)
    changed = sorted(k for k in after if after[k] != before.get(k) and k not in RESUME_SAFE)
    if changed:
        flags = ", ".join(f"--{k.replace('_', '-')} ({before.get(k)!r} -> {after[k]!r})" for k in changed)
        raise ValueError(f"--resume continues the run in {run_dir} as it was configured; these flags may not change "
                         f"mid-run: {flags}. Start a new run for that (with --logdir elsewhere).")
    return cfg


def _new_run_config(argv: list[str], file: str | None) -> Config:
    """A new run's config: parsed once to learn --env (and the algorithm and mode), then again over
    that environment's defaults (ENV_DEFAULTS), so that a flag given, even one equal to the global
    default, is never overridden. --help shows the defaults of the --env it is given with."""
    if "-h" in argv or "--help" in argv:  # tyro prints the help and exits on any parse
        from launch.configfile import config_from_file

        env = _flag_value(argv, "--env") or (config_from_file(Config, file).env if file else Config.env)
        under = env_defaults(env, _flag_value(argv, "--algo") or DEFAULT_ALGO, "--colocate" in argv)
    else:
        first = _parse(argv, file, {})
        under = env_defaults(first.env, first.algo, first.colocate)
        if not under:
            return first
    return _parse(argv, file, under)


def _parse(argv: list[str], file: str | None, under: dict) -> Config:
    """The flags over a --config file's settings over `under` (nested sections) over the defaults."""
    import tyro

    if file is not None:
        from launch.configfile import config_from_file

        default = config_from_file(Config, file, under)
    elif under:
        default = _build(Config, under)
        default.model = "auto"  # resolved again for the --env the flags give
    else:
        default = None
    return tyro.cli(Config, args=argv, default=default, prog=PROG)


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _flat(cfg, prefix: str = "") -> dict:
    import dataclasses

    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_flat(value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = value
    return out


def _build(cls, data: dict):
    """A dataclass of type `cls` from `dataclasses.asdict` output, nested sections included."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {', '.join(unknown)} (a config of another Tandem version?)")
    kwargs = {}
    for name, value in data.items():
        kind = hints[name]
        kwargs[name] = _build(kind, value) if dataclasses.is_dataclass(kind) and isinstance(value, dict) else value
    return cls(**kwargs)
