"""The shipped configs (sera_jax.harness.configs): by name, by path, the train flags, and one
spelling of every key they share."""

import importlib
import pathlib

import ml_collections
import pytest
from absl import flags

from sera_jax.harness import cli, configs, train
from sera_jax.settings.maze import task as maze_task

EXPERIMENT_CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "configs"
# Other spellings of keys the configs share -> the one name every config uses.
ALIASES = {"allocation": "method", "mode": "method", "num_generations": "baseline_n",
           "n0": "baseline_n", "lr": "learning_rate", "max_grad_norm": "grad_clip_norm",
           "clip_norm": "grad_clip_norm", "save_every": "checkpoint_every",
           "max_to_keep": "checkpoints_to_keep", "rng_seed": "seed", "gamma": "discount",
           "alpha": "alpha0", "beta": "beta0"}
LOOP_CONFIGS = [name for name in configs.names()
                if configs.load(name).get("task") in cli.LOOP_TASKS]


def test_names_are_the_shipped_files():
  assert configs.names() == ("default", "gsm8k_qwen3", "gsm8k_qwen3_1device", "gsm8k_smollm2",
                             "imagenet_resnet50", "math", "math_qwen25", "maze", "maze17",
                             "polaris_qwen3", "sim_nav", "synthetic1000")
  assert LOOP_CONFIGS == ["default", "imagenet_resnet50", "maze", "maze17", "sim_nav",
                          "synthetic1000"]


def keys(config: ml_collections.ConfigDict, prefix: str = "") -> dict[str, object]:
  """Every key of `config`, nested ones as "outer.inner", with its value."""
  flat = {}
  for key, value in config.items():
    flat[prefix + key] = value
    if isinstance(value, ml_collections.ConfigDict):
      flat |= keys(value, f"{prefix}{key}.")
  return flat


def other_spellings(config: ml_collections.ConfigDict) -> list[str]:
  """The keys of `config` spelt as an alias of a shared key, with the name to use."""
  return [f"{key} (use {ALIASES[key.rpartition('.')[2]]})" for key in keys(config)
          if key.rpartition(".")[2] in ALIASES]


def test_the_spelling_check_finds_an_alias_at_any_depth():
  config = ml_collections.ConfigDict({"baseline_n": 8, "num_generations": 8,
                                      "learner": {"allocation": "sera", "method": "sera"}})
  assert sorted(other_spellings(config)) == ["learner.allocation (use method)",
                                             "num_generations (use baseline_n)"]


@pytest.mark.parametrize("name", configs.names())
def test_every_config_spells_the_shared_keys_alike(name):
  assert other_spellings(configs.load(name)) == []


def test_a_shared_key_has_one_type_in_every_config():
  types = {}
  for name in configs.names():
    for key, value in keys(configs.load(name)).items():
      types.setdefault(key, {}).setdefault(type(value).__name__, []).append(name)
  assert {key: found for key, found in types.items() if len(found) > 1} == {}
  assert {"method", "estimator", "baseline_n", "n_min", "n_max", "threshold", "discount",
          "alpha0", "beta0", "learning_rate", "seed"} <= {
              key for key, found in types.items() if sum(map(len, found.values())) > 1}


def test_the_llm_configs_load_by_name():
  gsm8k = configs.load("gsm8k_qwen3")
  assert (gsm8k.task, gsm8k.method, gsm8k.baseline_n, gsm8k.batch_size) == ("gsm8k", "sera",
                                                                             16, 256)
  figure = configs.load("math")
  assert (figure.method, figure.baseline_n, figure.learning_rates) == ("sera", 8,
                                                                       (3e-4, 1e-3, 3e-3))
  assert "task" not in figure  # a figure's experiment, not a `sera-jax train` run


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
  with pytest.raises(FileNotFoundError,
                     match="default, gsm8k_qwen3, gsm8k_qwen3_1device, gsm8k_smollm2, "
                           "imagenet_resnet50, math"):
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
  with pytest.raises(ValueError, match=r"^--config\.batchsize: the config has no key "
                                       r"'batchsize'\.$"):
    configs.train_flags(["sera-jax train", "--config.batchsize=3"])
  with pytest.raises(flags.Error, match="invalid literal"):
    configs.train_flags(["sera-jax train", "--config.batch_size=three"])


@pytest.mark.parametrize("num_devices", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("name", LOOP_CONFIGS)
def test_every_shipped_config_passes_its_checks(name, num_devices):
  config = configs.load(name)
  importlib.import_module(train.SETTINGS[config.task][0]).validate_config(config, num_devices)
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


def test_train_refuses_a_figures_config_in_one_line(tmp_path):
  with pytest.raises(SystemExit, match="task is one of classification, maze, sim, gsm8k; got None"):
    cli.main(["train", "--config", "math", f"--workdir={tmp_path / 'run'}"])
  assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("flag", ["--workdir=runs/x", "--resume", "--multihost"])
def test_a_gsm8k_run_takes_no_workdir_flags(flag):
  with pytest.raises(SystemExit, match=f"error: {flag.split('=')[0]}: a gsm8k config trains "
                                       f"in one process"):
    cli.main(["train", "--config", "gsm8k_qwen3", flag])
