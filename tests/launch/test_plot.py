"""launch.plot labels a curve with the run's own environment and parts."""

import json

from launch.plot import _labels


def test_the_curve_names_the_runs_environment_and_parts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"env": "image-maze", "eval_episodes": 64, "actors": 6,
                                                      "learners": 2, "algo": "grpo"}))
    assert _labels(str(tmp_path)) == ("image-maze-64", "Tandem: GRPO on image-maze, 6 actors + 2 learners")
    (tmp_path / "config.json").write_text(json.dumps({"env": "maze", "eval_episodes": 32, "learners": 2,
                                                      "colocate": True, "algo": "ppo"}))
    assert _labels(str(tmp_path)) == ("maze-32", "Tandem: PPO on maze, 2 colocated learners")
    assert _labels(str(tmp_path / "missing")) == ("evaluation", "Tandem: GRPO")
