"""Where a run's scalars and sample episodes go besides TensorBoard: Weights & Biases, MLflow.

Each sink gets exactly what TensorBoard gets (`Board` hands every scalar to every sink, with the
same name and step), plus the sample episodes as text. Both libraries are optional and imported
only when asked for (`--log.wandb PROJECT`, `--log.mlflow URI`); a missing one stops the job at
start, saying what to install. W&B honours its own environment (`WANDB_MODE=offline` writes the
run under `<run dir>/wandb` with no network; `WANDB_API_KEY`), MLflow its tracking URI.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass


@dataclass
class LogConfig:
    """Logging besides TensorBoard (always on, in the run directory)."""

    wandb: str = ""
    """Weights & Biases project to log to as well (empty: off; needs `pip install wandb`; set
    WANDB_MODE=offline to write the run locally under <run dir>/wandb)."""
    mlflow: str = ""
    """MLflow tracking URI to log to as well, e.g. "file:./mlruns" or "http://host:5000" (empty: off;
    needs `pip install mlflow`)."""
    samples_every: int = 10
    """Log the newest group's first episodes as text (prompt, turns, rewards) every this many
    policy versions (0 = never)."""

    def __post_init__(self) -> None:
        if self.samples_every < 0:
            raise ValueError(f"--log.samples-every must be 0 (never) or more, got {self.samples_every}")

    def check(self) -> None:
        """ValueError, before the run starts, for a sink whose library is not installed."""
        for flag, module in (("--log.wandb", "wandb"), ("--log.mlflow", "mlflow")):
            if getattr(self, module) and importlib.util.find_spec(module) is None:
                raise ValueError(f"{flag} needs the {module} package: pip install {module}")


class WandbSink:
    def __init__(self, project: str, run_dir: str, config: dict) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project, name=os.path.basename(os.path.normpath(run_dir)), dir=run_dir,
                              config=config, resume="allow", id=_run_id(run_dir))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def text(self, step: int, tag: str, rows: list[dict]) -> None:
        table = self.wandb.Table(columns=list(rows[0])) if rows else None
        for row in rows:
            table.add_data(*row.values())
        if table is not None:
            self.run.log({tag: table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    def __init__(self, uri: str, run_dir: str, config: dict) -> None:
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment("tandem")
        self.run = mlflow.start_run(run_name=os.path.basename(os.path.normpath(run_dir)))
        flat = _flat_params(config)
        for i in range(0, len(flat), 100):  # MLflow takes at most 100 params a call
            mlflow.log_params(dict(list(flat.items())[i:i + 100]))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics({_mlflow_name(k): float(v) for k, v in values.items()}, step=step)

    def text(self, step: int, tag: str, rows: list[dict]) -> None:
        self.mlflow.log_text(json.dumps(rows, indent=1), f"{tag}/step-{step:06d}.json")

    def close(self) -> None:
        self.mlflow.end_run()


def make_sinks(log: LogConfig, run_dir: str, config: dict) -> list:
    """The sinks `log` asks for, opened (each one's library imported here)."""
    sinks: list = []
    if log.wandb:
        sinks.append(WandbSink(log.wandb, run_dir, config))
    if log.mlflow:
        sinks.append(MlflowSink(log.mlflow, run_dir, config))
    return sinks


def _run_id(run_dir: str) -> str:
    """A W&B run id fixed by the run directory, so that `--resume` continues the same W&B run."""
    import hashlib

    return hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:16]


def _mlflow_name(name: str) -> str:
    """MLflow allows letters, digits and _-. / space in names; anything else becomes _."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in name)


def _flat_params(config: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flat_params(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = str(v)[:500]
    return out
