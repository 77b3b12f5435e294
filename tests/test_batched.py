"""A batch of classification runs trained as one program is its runs, each trained alone."""

import importlib.util
import pathlib

import jax
import numpy as np
import pytest

from sera_jax.harness import batched as harness_batched
from sera_jax.harness import train
from sera_jax.harness.configs import default
from sera_jax.settings.classification import batched, task

STEPS = 3
# Metrics of the allocation's integer counts and of the groups' success counts: equal exactly.
COUNTED = ("rollouts/min", "rollouts/max", "active_fraction", "useful_group_fraction",
           "all_zero_group_fraction")
# Floats: the batched matmuls may round differently from the run's own.
RTOL, ATOL = 1e-5, 1e-6


def _config(method="sera", estimator="maxrl", **overrides):
  config = default.get_config()
  config.update(dict(method=method, estimator=estimator, batch_size=16, num_steps=STEPS,
                     eval_batch_size=512) | overrides)
  return config


# Seeds, learning rates, a momentum of 0 (no trace alone) and a weight decay, all differing.
RUNS = (dict(seed=0, learning_rate=0.01), dict(seed=1, learning_rate=0.05, momentum=0.0),
        dict(seed=2, learning_rate=0.1, weight_decay=1e-3))


def _alone(config):
  single = task.ClassificationTask(config)
  state = single.init_state(jax.random.PRNGKey(config.seed))
  rows = []
  for step in range(STEPS):
    state, metrics = single.train_step(state, step)
    rows.append(jax.device_get(metrics))
  return state, rows, single.evaluate(state)


def _assert_same_rows(alone_rows, together_rows, run):
  """Every row's keys alike, the counted metrics equal, the rest within RTOL, ATOL."""
  assert len(together_rows) == len(alone_rows)
  for step, (alone, together) in enumerate(zip(alone_rows, together_rows, strict=True)):
    assert set(together) == set(alone)
    assert "rollouts/max" in alone
    for key, value in alone.items():
      message = f"{run}, step {step}, {key}"
      if key in COUNTED:
        np.testing.assert_array_equal(together[key], value, err_msg=message)
      else:
        np.testing.assert_allclose(together[key], value, rtol=RTOL, atol=ATOL, err_msg=message)


@pytest.mark.slow
@pytest.mark.parametrize("method,estimator", [("sera", "maxrl"), ("uniform", "maxrl"),
                                              ("sera", "grpo")])
def test_each_run_of_a_batch_is_the_run_alone(method, estimator):
  configs = [_config(method, estimator, **run) for run in RUNS]
  runs = batched.BatchedClassification(configs)
  states = runs.init_state()
  rows = []
  for step in range(STEPS):
    states, metrics = runs.train_step(states, step)
    rows.append(jax.device_get(metrics))
  evaluations = runs.evaluate(states)

  for r, config in enumerate(configs):
    state, alone_rows, evaluation = _alone(config)
    _assert_same_rows(alone_rows, [{key: value[r] for key, value in row.items()} for row in rows],
                      f"run {r}")
    np.testing.assert_allclose(alone_rows[-1]["learning_rate"], rows[-1]["learning_rate"][r],
                               rtol=RTOL)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL),
                 batched.run_state(states, r).params, jax.device_get(state.params))
    assert evaluations[r].keys() == evaluation.keys()
    for key, value in evaluation.items():
      np.testing.assert_allclose(evaluations[r][key], value, rtol=RTOL, atol=ATOL, err_msg=key)
  # The runs did differ: their parameters and rates are not one run's.
  assert len({float(rate) for rate in rows[-1]["learning_rate"]}) == len(RUNS)
  first, second = (jax.tree.leaves(batched.run_state(states, r).params)[0] for r in (0, 1))
  assert not np.allclose(first, second)


@pytest.mark.parametrize("key,value", [("batch_size", 32), ("baseline_n", 4), ("n_max", 16),
                                       ("method", "uniform"), ("estimator", "grpo"),
                                       ("threshold", 0.1), ("model", "small_cnn")])
def test_a_key_outside_the_varied_ones_is_refused_by_name(key, value):
  configs = [_config(seed=0), _config(seed=1, learning_rate=0.05, **{key: value})]
  with pytest.raises(ValueError, match=rf"^config\.{key} differs between runs .* run 1\); "
                                       r"the runs of a batch may differ only in seed, "):
    batched.BatchedClassification(configs)


def test_seeds_and_optimizer_scalars_may_differ():
  configs = [_config(**run) for run in RUNS]
  batched.check_batchable(configs)  # does not raise
  with pytest.raises(ValueError, match="at least one config"):
    batched.check_batchable([])


@pytest.mark.slow
def test_run_batch_writes_each_run_as_train_run_writes_it(tmp_path):
  configs = [_config(eval_every=2, checkpoint_every=STEPS, **run) for run in RUNS[:2]]
  workdirs = [str(tmp_path / f"batch{r}") for r in range(len(configs))]
  rows = harness_batched.run_batch(configs, workdirs)
  for r, (config, workdir) in enumerate(zip(configs, workdirs, strict=True)):
    alone = train.run(config, str(tmp_path / f"alone{r}"))
    written = train.read_metrics(workdir)
    assert [row["step"] for row in written] == list(range(STEPS))
    assert "pass@1" in written[1] and "pass@1" in written[2] and "pass@1" not in written[0]
    _assert_same_rows(alone, written, f"run {r}")
    assert written == rows[r]
    saved = (tmp_path / f"batch{r}" / train.CONFIG_FILE).read_text()
    assert saved == (tmp_path / f"alone{r}" / train.CONFIG_FILE).read_text()
  with pytest.raises(ValueError, match="holds a run's rows"):
    harness_batched.run_batch(configs, workdirs)
  with pytest.raises(ValueError, match="its own workdir"):
    harness_batched.run_batch(configs, [workdirs[0]] * 2)


@pytest.mark.slow
def test_the_sweep_benchmark_times_both_ways():
  """A smoke test of benchmarks/sweep.py (no timing is asserted)."""
  path = pathlib.Path(__file__).parents[1] / "benchmarks" / "sweep.py"
  spec = importlib.util.spec_from_file_location("sweep_benchmark", path)
  benchmark = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(benchmark)
  seconds = benchmark.measure("mlp", runs=2, steps=2)
  assert set(seconds) == {"sequential_first", "sequential_rest", "batched_first", "batched_rest"}
  assert all(value > 0 for value in seconds.values())
