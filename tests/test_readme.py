"""The README, read as a new user would: every command in it is one that works, and its
"Write your own environment" example is saved as guess.py, checked with Gymnasium's checker,
played, and trained on with the main job.

Every command line in the README's shell blocks is checked here: `python -m launch.async ...`
lines parse into a valid config (a misspelt flag or a bad value fails), the other modules'
lines parse with their own argument parsers, the install and test lines are those CI runs
(`.ci/run`), and the example's commands run. The jobs themselves run in
tests/launch/test_smoke.py (the quick start with PPO, vLLM actors) and below (guess:GuessEnv)."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gymnasium.utils.env_checker import check_env

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def readme_commands() -> list[str]:
    """Each command of the README's ```bash blocks (comments dropped, `&&` chains split)."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.DOTALL)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [part.strip() for line in lines if line for part in line.split("&&")]


def example_source() -> str:
    text = README.read_text()
    section = text.split("## Write your own environment", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


@pytest.fixture
def guess(tmp_path):
    path = tmp_path / "guess.py"
    path.write_text(example_source())
    spec = importlib.util.spec_from_file_location("guess", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_is_about_thirty_lines():
    assert len(example_source().strip().splitlines()) <= 40


def test_example_passes_the_checker_and_plays(guess):
    env = guess.GuessEnv()
    check_env(env, skip_render_check=True)
    env.reset(options={"secret": 420})
    assert env.step("")[0][0]["content"] == "Answer with a number."
    assert env.step("maybe 100?")[0][0]["content"] == "Higher."
    assert env.step("9" * 5000)[0][0]["content"] == "Lower."
    obs, reward, terminated, _, _ = env.step("420")
    assert (obs[0]["content"], reward, terminated) == ("Correct!", 1.0, True)
    held = {t["secret"] for t in env.eval_tasks(env.eval_seed, 64)}
    assert len(held) == 64 and not held & {env.reset(seed=s) and env.secret for s in range(500)}


def test_example_trains_with_the_main_job(guess, tmp_path):
    """The fast tier's one whole job (real Ray, processes, sockets): the README's own example."""
    run = subprocess.run([sys.executable, "-m", "launch.async", "--env", "guess:GuessEnv", "--steps", "2",
                          "--actors", "2", "--learners", "1", "--eval-episodes", "4",
                          "--learner.groups-per-step", "2", "--actor.group-size", "4",
                          "--logdir", str(tmp_path / "run")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "done: 2 steps" in run.stdout


def _argv(command: str, module: str) -> list[str]:
    import shlex

    return shlex.split(command)[len(["python", "-m", module]):]


def test_the_readme_is_for_users_not_a_lab_notebook():
    """Measurements live in docs/, dated, with the commands that reproduce them."""
    assert len(README.read_text().splitlines()) <= 250
    for doc in re.findall(r"\]\((docs/[\w.]+\.md)", README.read_text()):
        text = (ROOT / doc).read_text()
        assert re.search(r"20\d\d-\d\d-\d\d", text), f"{doc} carries no date"
        assert "python -m " in text, f"{doc} names no command that reproduces it"


def test_every_readme_command_is_known_and_parses(tmp_path, monkeypatch):
    import shutil

    import tyro

    from launch.config import Config
    from launch.eval import EvalArgs
    from launch.merge import MergeArgs
    from launch.plot import PlotArgs
    from launch.tinker import TinkerArgs

    ci = (ROOT / ".ci" / "run").read_text().replace(" -q", "")
    pyproject = (ROOT / "pyproject.toml").read_text()
    extras = set(re.findall(r"^([\w-]+) = \[", pyproject.split("[project.optional-dependencies]")[1].split("\n[")[0],
                            re.MULTILINE))
    parsers = {"launch.eval": EvalArgs, "launch.plot": PlotArgs, "launch.merge": MergeArgs, "launch.tinker": TinkerArgs}
    (tmp_path / "guess.py").write_text(example_source())  # the example's commands run beside it
    monkeypatch.syspath_prepend(str(tmp_path))
    commands = readme_commands()
    ray_help = None
    assert "python -m launch.async --actors 6 --learners 2" in commands  # the quick start
    for command in commands:
        if command.startswith("python -m launch.async"):
            tyro.cli(Config, args=_argv(command, "launch.async"))  # raises on an unknown flag or a bad value
        elif command.startswith("python -m "):
            module = command.split()[2]
            if module in parsers:
                tyro.cli(parsers[module], args=_argv(command, module))
            else:
                pytest.fail(f"README command {command!r}: add its module to this test")
        elif command.startswith("pip install -e"):
            extra = re.fullmatch(r"pip install -e (?:\.|'\.\[([\w-]+)\]')", command)
            assert extra, command
            assert extra.group(1) in extras | {None}, f"{command!r}: no such extra in pyproject.toml"
        elif command.startswith(("pip uninstall", "pytest")):
            assert command in ci, f"{command!r} is not what .ci/run does"
        elif command.startswith("ray start "):  # every flag is one `ray start` has
            if ray_help is None:
                ray_help = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "start", "--help"],
                                          capture_output=True, text=True, timeout=120).stdout
            for flag in re.findall(r"(--[\w-]+)", command):
                assert f"{flag} " in ray_help or f"{flag}\n" in ray_help, f"{command!r}: ray start has no {flag}"
        elif command.startswith("export "):  # only the variables Ray reads for its token
            names = [kv.split("=")[0] for kv in command.split()[1:]]
            assert names == ["RAY_AUTH_MODE", "RAY_AUTH_TOKEN"] and "RAY_AUTH_MODE=token" in command, command
        elif command.startswith("tensorboard "):
            assert shutil.which("tensorboard") or importlib.util.find_spec("tensorboard"), command
        elif not command.startswith("python -c "):  # the checker line: run below
            pytest.fail(f"README command {command!r} is not checked by this test")
    assert "pip install -e '.[test]'" in ci and "pip install -e '.[test]'" in commands


def test_the_example_checker_command_runs(guess, tmp_path):
    line = next(c for c in readme_commands() if c.startswith("python -c "))
    import shlex

    (tmp_path / "guess.py").write_text(example_source())
    run = subprocess.run([sys.executable, *shlex.split(line)[1:]], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_run_directory_the_readme_names_is_the_one_the_job_prints():
    """The quick start's last line is the job's own `done:` line (launch/async.py), naming the
    directory a default run writes to (Config.run_dir: runs/<env>-<mode>-<time>)."""
    from launch.config import Config

    text = README.read_text()
    named = re.search(r"^done: .*; adapter in (\S+)/adapter$", text, re.MULTILINE)
    assert named, "the quick start shows no `done:` line"
    pattern = re.escape(Config().run_dir[:-len("20261130-060712")]) + r"\d{8}-\d{6}"
    assert re.fullmatch(pattern, named.group(1)), (named.group(1), pattern)
    printed = (ROOT / "launch" / "async.py").read_text()
    assert 'f"adapter in {logdir}/adapter"' in printed and "logdir = cfg.run_dir" in printed
    assert "runs/<run>" in text and "runs/default" not in text


def test_the_faults_doc_lists_every_flag_resume_may_change():
    from launch.config import RESUME_SAFE

    text = (ROOT / "docs" / "faults.md").read_text()
    for name in RESUME_SAFE:
        if name != "resume":
            assert f"`--{name.replace('_', '-')}`" in text, name


def test_the_anchor_table_names_only_flags_we_have():
    """docs/coming-from.md maps verl / TRL / SkyRL names to ours: every flag in our column exists."""
    from launch.config import _flat, Config

    doc = (ROOT / "docs" / "coming-from.md").read_text()
    ours = [row.rsplit("|", 2)[-2] for row in doc.splitlines() if row.startswith("| ") and "---" not in row][1:]
    known = {"--" + k.replace("_", "-") for k in _flat(Config())} | {"--config", "--learner.no-normalize-std"}
    named = {f for cell in ours for f in re.findall(r"(--[\w.-]+[\w])", cell)}
    assert len(named) > 25 and named <= known, named - known


def api_example() -> str:
    section = README.read_text().split("## In one process", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_api_example_uses_names_that_exist():
    """Fast: every import of the README's Python API example resolves."""
    for module, names in re.findall(r"^from ([\w.]+) import (.+)$", api_example(), re.MULTILINE):
        imported = importlib.import_module(module)
        for name in names.split(", "):
            assert hasattr(imported, name), f"{module}.{name}"


@pytest.mark.slow
def test_the_api_example_trains_in_one_process(tmp_path):
    """The README's actor + learner + local replay in one process: two GRPO steps on the maze."""
    (tmp_path / "example.py").write_text(api_example())
    run = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rewards = [float(line) for line in run.stdout.strip().splitlines()[-2:]]  # what the loop printed
    assert all(0.0 <= r <= 1.0 for r in rewards), run.stdout
