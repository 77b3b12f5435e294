"""The shipped configs (sera_jax.harness.configs): by name, by path, and the train flags."""

import pathlib

import pytest
from absl import flags

from sera_jax.harness import cli, configs, train
from sera_jax.settings.classification import task as classification_task
from sera_jax.settings.maze import task as maze_task

EXPERIMENT_CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "configs"


def test_names_are_the_shipped_files():
  assert configs.names() == ("default", "imagenet_resnet50", "maze", "maze17", "synthetic1000")


@pytest.mark.parametrize("name", configs.names())
def test_a_name_and_its_experiments_path_load_the_same_locked_config(name):
  by_name = configs.load(name)
  by_path = configs.load(EXPERIMENT_CONFIGS / f"{name}.py")
  assert by_name.to_dict() == by_path.to_dict()
  with pytest.raises(AttributeError):
    by_name.no_such_key = 1  # locked: a misspelt key fails


def test_an_existing_file_wins_over_a_name(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "default").write_text("def get_config():\n  return 'the local file'\n")
  assert configs.load("default") == "the local file"


def test_an_unknown_config_lists_the_shipped_names():
  with pytest.raises(FileNotFoundError, match="default, imagenet_resnet50, maze"):
    configs.config_file("synthetic999")


@pytest.mark.parametrize("form", [["--config", "synthetic1000"], ["--config=synthetic1000"]])
def test_train_flags_take_a_name_with_overrides(form):
  values = configs.train_flags(["sera-jax train", *form, "--config.num_steps=7"])
  assert values.config.dataset == "synthetic" and values.config.num_steps == 7
  assert pathlib.Path(values["config"].config_filename).parent == configs.CONFIG_DIR


@pytest.mark.parametrize("name,override", [
    ("default", "--config.dataset_kwargs.num_validation=300"),
    ("synthetic1000", "--config.dataset_kwargs.num_validation=300"),
    ("maze", "--config.num_validation_mazes=64")])
def test_a_validation_split_is_one_override(name, override):
  config = configs.train_flags(["sera-jax train", "--config", name, override]).config
  value = (config.num_validation_mazes if name == "maze"
           else config.dataset_kwargs.num_validation)
  assert value == int(override.split("=")[1])


def test_train_flags_default_and_bad_override():
  assert configs.train_flags(["sera-jax train"]).config.dataset == "digits"
  with pytest.raises((flags.Error, AttributeError, KeyError)):
    configs.train_flags(["sera-jax train", "--config.batchsize=3"])


@pytest.mark.parametrize("num_devices", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("name", configs.names())
def test_every_shipped_config_passes_its_checks(name, num_devices):
  config = configs.load(name)
  if config.task == "classification":
    classification_task.validate_config(config, num_devices)
  else:
    maze_task.validate_config(config, num_devices)
  train.validate_run_config(config)


def test_the_maze_checks_name_the_split_that_does_not_divide():
  config = configs.load("maze")
  maze_task.validate_config(config, 32)
  with pytest.raises(ValueError, match="config.batch_size must be divisible by the device"):
    maze_task.validate_config(config, 64)
  config.update(batch_size=256, microbatches=16)  # 2048 rollouts, 128 a microbatch
  with pytest.raises(ValueError, match="rollouts of a microbatch.*with 256 devices"):
    maze_task.validate_config(config, 256)


@pytest.mark.parametrize("override, message", [
    ({"learning_rate": -1.0}, "config.learning_rate must be > 0"),
    ({"checkpoint_every": 0}, "config.checkpoint_every must be >= 1"),
    ({"num_steps": 0}, "config.num_steps must be >= 1"),
    ({"num_steps": -3}, "config.num_steps must be >= 1"),
    ({"eval_batch_size": 0}, "config.eval_batch_size must be >= 1"),
    ({"momentum": 1.0}, "config.momentum must be < 1.0"),
    ({"weight_decay": -1e-4}, "config.weight_decay must be >= 0.0"),
])
def test_impossible_values_are_rejected_before_anything_is_built(tmp_path, override, message):
  config = configs.load("default")
  config.update(override)
  with pytest.raises(ValueError, match=message):
    train.run(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, message", [
    ({"seed": -1}, "config.seed must be >= 0"),
    ({"data_seed": -1}, "config.data_seed must be >= 0"),
    ({"max_steps": -1}, "config.max_steps must be >= 0"),
    ({"discount": 1.5}, r"config.discount must lie in \[0, 1\]"),
    ({"alpha0": 0.0}, "config.alpha0 must be > 0"),
    ({"beta0": -1.0}, "config.beta0 must be > 0"),
    ({"num_eval_mazes": 0}, "config.num_eval_mazes must be >= 1"),
])
def test_impossible_maze_values_are_rejected_before_anything_is_built(tmp_path, override,
                                                                       message):
  config = configs.load("maze")
  config.update(override)
  with pytest.raises(ValueError, match=message):
    train.run(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_a_negative_seed_stops_the_command_before_it_writes(tmp_path):
  # The seed was once checked only by the first batch, after the workdir and its writers.
  with pytest.raises(SystemExit, match="error: config.seed must be >= 0; got -1"):
    cli.main(["train", "--config.seed=-1", f"--workdir={tmp_path / 'run'}"])
  assert not list(tmp_path.iterdir())
