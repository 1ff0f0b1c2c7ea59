"""`launch.eval` in process on the tiny model: the engine evaluates a saved adapter with the LoRA
spec it was saved with, and an adapter it cannot apply is refused with a message that names it."""

import json
import re

import pytest
import torch

from launch.eval import EvalArgs, main
from policy.adapter import write_adapter
from policy.load import LoraSpec
from tests.policy.test_adapter import _trained

Q_V = LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])


def _save(tiny_model, spec, path, version=5):
    """An adapter of `spec` on the tiny model, its B matrices off zero, saved as the learner saves it."""
    _, tensors = _trained(tiny_model, spec)
    write_adapter(path, tensors, spec, tiny_model, version)
    return tensors


def test_an_adapter_with_its_own_target_modules_is_evaluated_as_saved(tiny_model, tmp_path, monkeypatch):
    """Saved with q_proj and v_proj only (rank 4, alpha 8): the engine's adapter has exactly the
    saved tensors, not the default "all-linear" layers of the default rank with these copied in."""
    from peft import get_peft_model_state_dict
    from peft.tuners.lora import LoraLayer

    from launch.monitor import Evaluator

    saved = _save(tiny_model, Q_V, tmp_path / "adapter")
    seen = {}
    evaluate = Evaluator.evaluate

    def watched(self, *args, **kwargs):
        seen["lora"] = self.cfg.learner.lora  # what the engine was built with
        seen["tensors"] = {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.engine.model).items()}
        seen["scaling"] = {m.scaling["default"] for m in self.engine.model.modules() if isinstance(m, LoraLayer)}
        seen["version"] = self.version
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(Evaluator, "evaluate", watched)
    result = main(EvalArgs(str(tmp_path / "adapter"), episodes=2))
    assert result["episodes"] == 2 and 0.0 <= result["success_rate"] <= 1.0
    assert seen["lora"].to_dict() == Q_V.to_dict() and seen["version"] == 5
    assert seen["tensors"].keys() == saved.keys()
    for k in saved:
        torch.testing.assert_close(seen["tensors"][k], saved[k], rtol=0, atol=0)
    assert seen["scaling"] == {Q_V.alpha / Q_V.rank}


def _edit(path, config=None, rename=None):
    """Rewrite the saved adapter at `path`: `config` updates its adapter_config.json, `rename`
    (old, new) renames its tensors' module."""
    from safetensors.torch import load_file, save_file

    if config:
        file = path / "adapter_config.json"
        file.write_text(json.dumps({**json.loads(file.read_text()), **config}))
    if rename:
        tensors = load_file(str(path / "adapter_model.safetensors"))
        save_file({k.replace(*rename): v for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))


@pytest.mark.parametrize("edit, problem", [
    # The model has no module of that name: the engine's LoRA layers cannot be built.
    (dict(config={"target_modules": ["qq_proj", "v_proj"]}, rename=("q_proj", "qq_proj")), "qq_proj"),
    # A module pattern (PEFT takes a regular expression there); the engines take names.
    (dict(config={"target_modules": r".*\.(q|v)_proj"}), "list of module names"),
    # The config names modules the tensors do not adapt.
    (dict(config={"target_modules": ["k_proj", "q_proj", "v_proj"]}), r"adapt \['q_proj', 'v_proj'\]"),
    (dict(config={"use_dora": True}), "use_dora=True"),
], ids=["unknown-module", "pattern", "config-and-tensors-disagree", "dora"])
def test_target_modules_the_engine_cannot_apply_are_refused_naming_the_adapter(tiny_model, tmp_path, edit,
                                                                               problem):
    path = tmp_path / "adapter"
    _save(tiny_model, Q_V, path)
    _edit(path, **edit)
    with pytest.raises(SystemExit) as exit:
        main(EvalArgs(str(path), episodes=1))
    message = str(exit.value.code)
    assert str(path) in message, message
    assert re.search(problem, message), message


def test_a_run_directory_is_scored_with_its_own_config(tiny_model, tmp_path):
    """A run trained with non-default settings (a 3×3 maze of 5 moves, 4 new tokens a turn, 3
    evaluation tasks): launch.eval on its adapter scores exactly what the run's own evaluator (the
    driver's, built from the same config) scores, and not what the defaults would."""
    from launch.config import Config
    from launch.monitor import Evaluator

    run = tmp_path / "run"
    cfg = Config(learners=1, model=tiny_model, eval_episodes=3, logdir=str(run))
    cfg.maze.size, cfg.maze.max_steps, cfg.actor.max_new_tokens = 3, 5, 4
    run.mkdir()
    (run / "config.json").write_text(cfg.to_json())
    saved = _save(tiny_model, Q_V, run / "adapter")
    cfg.learner.lora = Q_V
    own = Evaluator(cfg, tiny_model)
    try:
        own.load(5, saved)
        expected = own.evaluate()
        assert {t["maze"].shape for t in own.tasks} == {(3, 3)}
    finally:
        own.close()
    for given in (run / "adapter", run):  # the adapter, or the run directory that holds it
        assert main(EvalArgs(str(given))) == expected
    assert expected["episodes"] == 3 and expected["turns_mean"] <= 5  # the defaults: 64 tasks, up to 12 moves


def test_a_run_config_that_does_not_parse_is_refused_naming_it(tiny_model, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _save(tiny_model, Q_V, run / "adapter")
    (run / "config.json").write_text(json.dumps({"steps": 3, "no_such_flag": 1}))
    with pytest.raises(SystemExit) as exit:
        main(EvalArgs(str(run / "adapter"), episodes=1))
    assert "config.json" in str(exit.value.code) and "no_such_flag" in str(exit.value.code)


@pytest.mark.slow
def test_eval_of_a_trained_run_scores_what_the_run_scored(tmp_path):
    """A 2-step run on 3×3 mazes of at most 6 moves with 8 evaluation mazes: `launch.eval` on its
    directory, with no other flag, gives the success rate the run printed for its final adapter."""
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    run = subprocess.run([sys.executable, "-m", "launch.async", "--steps", "2", "--actors", "2", "--learners", "1",
                          "--learner.groups-per-step", "2", "--eval-episodes", "8", "--maze.size", "3",
                          "--maze.max-steps", "6", "--logdir", str(run_dir)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    final = re.search(r"-> ([\d.]+)% \(v(\d+)\); adapter in", run.stdout)
    scored = subprocess.run([sys.executable, "-m", "launch.eval", str(run_dir)], capture_output=True, text=True,
                            timeout=900)
    assert scored.returncode == 0, scored.stderr[-3000:]
    result = json.loads(scored.stdout.strip().splitlines()[-1])
    assert result["episodes"] == 8 and f"{result['success_rate']:.1%}" == f"{final.group(1)}%"
    assert "8 tasks of maze" in scored.stdout and "config.json" in scored.stdout
