"""A batch of classification runs trained as one program is its runs, each trained alone."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from sera_jax.common import batching
from sera_jax.harness import batched as harness_batched
from sera_jax.harness import configs, sweep, train
from sera_jax.harness.configs import default
from sera_jax.settings.classification import batched, gradients, task
from sera_jax.settings.maze import batched as maze_batched
from sera_jax.settings.maze import task as maze_task

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


# Seeds, learning rates, a momentum of 0 (no trace alone), a weight decay and a threshold
# that switches prompts off, all differing.
RUNS = (dict(seed=0, learning_rate=0.01), dict(seed=1, learning_rate=0.05, momentum=0.0),
        dict(seed=2, learning_rate=0.1, weight_decay=1e-3, threshold=0.9))


def _train(trainer, state, steps):
  """(final state, each step's metrics on the host) of `steps` train steps of `trainer` (a
  task or a batch of runs) from `state`."""
  rows = []
  for step in range(steps):
    state, metrics = trainer.train_step(state, step)
    rows.append(jax.device_get(metrics))
  return state, rows


def _alone(config):
  single = task.ClassificationTask(config)
  state, rows = _train(single, single.init_state(jax.random.PRNGKey(config.seed)), STEPS)
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
@pytest.mark.parametrize("sampling", ["vmapped", "in slices"])
@pytest.mark.parametrize("method,estimator", [("sera", "maxrl"), ("uniform", "maxrl"),
                                              ("sera", "grpo")])
def test_each_run_of_a_batch_is_the_run_alone(method, estimator, sampling, monkeypatch):
  if sampling == "in slices":  # as a batch with many rollouts samples them on the CPU
    monkeypatch.setattr(gradients, "_SLICED_MIN_SLOTS", 0)
  configs = [_config(method, estimator, **run) for run in RUNS]
  runs = batched.BatchedClassification(configs)
  states, rows = _train(runs, runs.init_state(), STEPS)
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
  # The runs did differ: their parameters and rates are not one run's, and SERA's threshold
  # (run 2's) left fewer prompts active.
  assert len({float(rate) for rate in rows[-1]["learning_rate"]}) == len(RUNS)
  if method == "sera":
    fractions = np.array([row["active_fraction"] for row in rows])
    assert np.all(fractions[:, 2] < fractions[:, 0])
  first, second = (jax.tree.leaves(batched.run_state(states, r).params)[0] for r in (0, 1))
  assert not np.allclose(first, second)


@pytest.mark.parametrize("key,value", [("batch_size", 32), ("baseline_n", 4), ("n_max", 16),
                                       ("method", "uniform"), ("estimator", "grpo"),
                                       ("normalize_by_rho", True), ("model", "small_cnn")])
def test_a_key_outside_the_varied_ones_is_refused_by_name(key, value):
  configs = [_config(seed=0), _config(seed=1, learning_rate=0.05, **{key: value})]
  with pytest.raises(ValueError, match=rf"^config\.{key} differs between runs .* run 1\); "
                                       r"the runs of a batch may differ only in seed, "):
    batched.BatchedClassification(configs)


def test_seeds_and_optimizer_and_allocation_scalars_may_differ():
  configs = [_config(**run) for run in RUNS]
  batched.check_batchable(configs)  # does not raise
  with pytest.raises(ValueError, match="at least one config"):
    batched.check_batchable([])


@pytest.mark.parametrize("jit", [False, True])
def test_cond_any_computes_a_batch_branch_only_when_some_run_needs_it(jit):
  calls = []

  def compute(x):
    jax.debug.callback(lambda: calls.append(None))
    return x + 1.0

  def one_run(needed, x):
    return batching.cond_any(needed, compute, jnp.zeros_like, x)

  runs, nested = jax.vmap(one_run), jax.vmap(jax.vmap(one_run))
  if jit:
    runs, nested = jax.jit(runs), jax.jit(nested)
  x = jnp.arange(6.0).reshape(2, 3)
  none = jnp.zeros((2, 3), bool)
  for mapped in (runs, nested):
    # A vmapped lax.cond would run `compute` (its callback) for every run here.
    np.testing.assert_array_equal(mapped(none, x), np.zeros((2, 3)))
    jax.effects_barrier()
    assert not calls
    np.testing.assert_array_equal(mapped(none.at[1, 2].set(True), x), x + 1)
    jax.effects_barrier()
    assert calls
    calls.clear()


def test_a_batch_of_one_run_runs_the_function_itself():
  # vmap turns a dynamic update slice into a scatter; a batch of one run keeps the run's own
  # program (XLA's CPU backend lays out a leading axis of size 1 otherwise, at a cost).
  def write(cache, update, step):
    return jax.lax.dynamic_update_slice_in_dim(cache, update, step, axis=0)

  in_axes = (0, 0, None)
  for runs, mesh, vmapped in ((1, None, False), (2, None, True),
                              (1, batching.runs_mesh(1, jax.devices()[:1]), True)):
    mapped = batching.vmap_runs(write, in_axes, mesh)
    cache, update = jnp.zeros((runs, 5, 3)), jnp.arange(runs * 3.0).reshape(runs, 1, 3)
    assert ("scatter" in str(jax.make_jaxpr(mapped)(cache, update, 2))) == vmapped
    np.testing.assert_array_equal(jax.jit(mapped)(cache, update, 2),
                                  jax.vmap(write, in_axes)(cache, update, 2))


@pytest.mark.parametrize("platform,loops", [("cpu", True), ("cuda", False), ("tpu", False)])
def test_a_batch_looping_on_the_cpu_loops_there_alone_and_equals_the_vmap(platform, loops):
  def step(params, data, scale):
    return jnp.tanh(data @ params) * scale

  in_axes = (0, 0, None)
  params = jax.random.normal(jax.random.PRNGKey(0), (3, 4, 4))
  data = jax.random.normal(jax.random.PRNGKey(1), (3, 8, 4))
  looped = jax.jit(batching.vmap_runs(step, in_axes, None, loop_on_cpu=True))
  program = looped.trace(params, data, 2.0).lower(lowering_platforms=(platform,)).as_text()
  # A loop over the three runs, each multiplying its own [8, 4] by [4, 4]; or one batched dot.
  assert ("stablehlo.while" in program) == loops
  assert ("batching_dims = [0] x [0]" in program) != loops
  np.testing.assert_array_equal(looped(params, data, 2.0),
                                jax.jit(jax.vmap(step, in_axes))(params, data, 2.0))
  # A runs mesh maps the runs over its devices: no loop.
  on_mesh = batching.vmap_runs(step, in_axes, batching.runs_mesh(1, jax.devices()[:1]),
                               loop_on_cpu=True)
  assert "while" not in str(jax.make_jaxpr(on_mesh)(params, data, 2.0))


def test_a_batch_draws_a_runs_tail_words_as_the_run_alone():
  """One run's first word is all zeros: the batch draws every run's tail words, and
  each run's log U is still its own."""
  leading = jax.random.bits(jax.random.key(0), (3, 64), jnp.uint32).at[1, 5].set(0)
  mantissa = jax.random.bits(jax.random.key(1), (3, 64), jnp.uint32)
  tail_keys = jax.random.split(jax.random.key(2), 3)
  draw_tail = lambda key: jax.random.bits(key, (64, 3), jnp.uint32)  # noqa: E731

  def log_u(leading, mantissa, tail_key):
    return gradients._log_uniform_from_bits(leading, mantissa, draw_tail, tail_key,
                                            jnp.float32)

  together = jax.jit(jax.vmap(log_u))(leading, mantissa, tail_keys)
  for r in range(3):
    np.testing.assert_array_equal(together[r], log_u(leading[r], mantissa[r], tail_keys[r]))
  assert together[1, 5] < -32 * np.log(2.0)  # the tail's zeros were counted


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
    assert list((tmp_path / f"batch{r}" / train.TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    # A sweep or a figure finds the run finished without its own checkpoints.
    assert harness_batched.run_outcome(workdir) == harness_batched.RunOutcome(
        harness_batched.default_batch_dir(workdirs), STEPS, None)
    assert sweep.is_done(workdir, STEPS) and not sweep.is_done(workdir, STEPS + 1)
  # Run again, the finished batch resumes at its end; other runs in its workdirs are refused.
  assert harness_batched.run_batch(configs, workdirs) == rows
  with pytest.raises(ValueError, match="not of this batch"):
    harness_batched.run_batch(configs, workdirs[::-1])
  with pytest.raises(ValueError, match="its own workdir"):
    harness_batched.run_batch(configs, [workdirs[0]] * 2)


class _Killed(Exception):
  """What the test raises in place of a kill."""


class _Observed:
  """A batch whose train_step records the steps it is asked for, raising _Killed at kill_at."""

  def __init__(self, batch, kill_at=None):
    self._batch, self._kill_at, self.steps = batch, kill_at, []

  def __getattr__(self, name):
    return getattr(self._batch, name)

  def train_step(self, states, step):
    self.steps.append(step)
    if step == self._kill_at:
      raise _Killed(step)
    return self._batch.train_step(states, step)


class _Poisoned(_Observed):
  """A batch whose run `run`'s parameters become NaN in step `step`."""

  def __init__(self, batch, run, step):
    super().__init__(batch)
    self._run, self._step = run, step

  def train_step(self, states, step):
    states, metrics = super().train_step(states, step)
    if step == self._step:
      states = states._replace(params=jax.tree.map(
          lambda x: x.at[self._run].set(np.nan), states.params))
    return states, metrics


@pytest.mark.slow
def test_a_non_finite_run_stops_alone_and_is_reported(tmp_path, caplog):
  configs = [_config(num_steps=4, eval_every=0, checkpoint_every=4, **run) for run in RUNS[:2]]
  workdirs = [str(tmp_path / f"run{r}") for r in range(2)]
  poisoned = _Poisoned(batched.BatchedClassification(configs), run=1, step=2)
  rows = harness_batched.run_batch(configs, workdirs, batch=poisoned)
  assert [row["step"] for row in rows[0]] == [0, 1, 2, 3]
  assert [row["step"] for row in rows[1]] == [0, 1]  # its state went non-finite in step 2
  assert [row["step"] for row in train.read_metrics(workdirs[1])] == [0, 1]
  assert [harness_batched.run_outcome(w).stopped_at for w in workdirs] == [None, 2]
  assert sweep.is_done(workdirs[0], 4) and sweep.is_done(workdirs[1], 4)  # both: no retraining
  _assert_same_rows(_alone(configs[0])[1],
                    [{key: value for key, value in row.items() if key != "step"}
                     for row in rows[0][:STEPS]], "run 0")
  assert f"{workdirs[1]}: non-finite state" in caplog.text and "at step 2" in caplog.text
  assert workdirs[0] not in caplog.text


def _final_checkpoint(batch_dir, step):
  manager = ocp.CheckpointManager(pathlib.Path(batch_dir) / train.CHECKPOINT_DIR)
  try:
    return manager.restore(step, args=ocp.args.StandardRestore())
  finally:
    manager.close()


@pytest.mark.slow
def test_a_killed_batch_resumes_exactly(tmp_path):
  configs = [_config(num_steps=6, checkpoint_every=2, eval_every=3, **run) for run in RUNS[:2]]
  whole_dirs = [str(tmp_path / f"whole{r}") for r in range(2)]
  whole = harness_batched.run_batch(configs, whole_dirs, batch_dir=str(tmp_path / "whole"))

  killed_dirs = [str(tmp_path / f"killed{r}") for r in range(2)]
  killed = _Observed(batched.BatchedClassification(configs), kill_at=5)
  with pytest.raises(_Killed):
    harness_batched.run_batch(configs, killed_dirs, batch_dir=str(tmp_path / "killed"),
                              batch=killed)
  assert killed.steps == list(range(6))  # killed in step 5, after the checkpoint of step 4
  for workdir in killed_dirs:  # step 4's row was written after that checkpoint
    assert [row["step"] for row in train.read_metrics(workdir)] == list(range(5))

  resumed = _Observed(batched.BatchedClassification(configs))
  rows = harness_batched.run_batch(configs, killed_dirs, batch_dir=str(tmp_path / "killed"),
                                   batch=resumed)
  assert resumed.steps == [4, 5]  # from the checkpoint of step 4, step 4 redone
  assert rows == whole
  for workdir, whole_rows in zip(killed_dirs, whole, strict=True):
    assert train.read_metrics(workdir) == whole_rows
  after_kill, uninterrupted = (_final_checkpoint(tmp_path / name, 6)
                               for name in ("killed", "whole"))
  jax.tree.map(np.testing.assert_array_equal, after_kill, uninterrupted)
  assert after_kill["live"].tolist() == [True, True]


_KILLED = 86  # the exit status of the batch the script below ends
# Trains the batch of RUNS[:2] (6 steps, a checkpoint every 2) into WORKDIR0, WORKDIR1 and
# BATCH_DIR, and ends the process as SIGKILL would (no `finally`, no flush, no wait for Orbax)
# as step 5 begins, once it sees the checkpoint of step 4 finalised on disk.
_KILL_IN_STEP_FIVE = """
import os, pathlib, sys, time
from test_batched import RUNS, _config, _Observed
from sera_jax.harness import batched as harness_batched, train
from sera_jax.settings.classification import batched

workdirs, batch_dir = sys.argv[1:3], sys.argv[3]
checkpoint_four = pathlib.Path(batch_dir) / train.CHECKPOINT_DIR / "4"

class KilledInStepFive(_Observed):
  def train_step(self, states, step):
    if step == 5:
      while not checkpoint_four.exists():  # Orbax renames it into place when it is complete
        time.sleep(0.01)
      os._exit(int(sys.argv[4]))
    return super().train_step(states, step)

configs = [_config(num_steps=6, checkpoint_every=2, eval_every=3, **run) for run in RUNS[:2]]
harness_batched.run_batch(configs, workdirs, batch_dir=batch_dir,
                          batch=KilledInStepFive(batched.BatchedClassification(configs)))
"""


@pytest.mark.slow
def test_a_batch_killed_as_a_process_resumes_exactly(tmp_path):
  """SIGKILL, not an exception: the killed process leaves its logs unclosed and its rows since
  the last checkpoint unflushed; the resumed batch still ends as the uninterrupted one."""
  configs = [_config(num_steps=6, checkpoint_every=2, eval_every=3, **run) for run in RUNS[:2]]
  whole = harness_batched.run_batch(configs, [str(tmp_path / f"whole{r}") for r in range(2)],
                                    batch_dir=str(tmp_path / "whole"))
  workdirs = [str(tmp_path / f"killed{r}") for r in range(2)]
  killed = subprocess.run(
      [sys.executable, "-c", _KILL_IN_STEP_FIVE, *workdirs, str(tmp_path / "killed"),
       str(_KILLED)], cwd=os.path.dirname(__file__), capture_output=True, text=True, timeout=600)
  assert killed.returncode == _KILLED, f"not killed in step 5:\n{killed.stderr[-2000:]}"
  for workdir in workdirs:  # no batch_run.json: the batch never ended
    assert harness_batched.run_outcome(workdir) is None

  resumed = _Observed(batched.BatchedClassification(configs))
  rows = harness_batched.run_batch(configs, workdirs, batch_dir=str(tmp_path / "killed"),
                                   batch=resumed)
  assert resumed.steps == [4, 5]
  assert rows == whole
  for workdir, whole_rows in zip(workdirs, whole, strict=True):
    assert train.read_metrics(workdir) == whole_rows
    assert harness_batched.run_outcome(workdir).stopped_at is None
  jax.tree.map(np.testing.assert_array_equal, _final_checkpoint(tmp_path / "killed", 6),
               _final_checkpoint(tmp_path / "whole", 6))


def _maze_config(method="sera", **overrides):
  config = configs.load("maze")
  # Epochs of 2 RL steps: SERA allocates at step 2. After a warm start on 128 7x7 mazes the RL
  # set's p runs from 0 to about 0.3, so the RL gradients are not all 0.
  config.update(dict(method=method, maze_size=7, num_validation_mazes=0, num_sft_mazes=128,
                     sft_batch_size=8, sft_learning_rate=1e-2, eval_samples=256,
                     sft_disjoint_paths=False,
                     num_train_mazes=8, batch_size=4, baseline_n=4,
                     n_min=2, n_max=8, num_eval_mazes=2, eval_batch_size=2, dim=16,
                     num_layers=1, num_heads=2,
                     num_steps=MAZE_STEPS) | overrides)
  return config


MAZE_STEPS = 4
# Seeds, every optimizer scalar and every allocation scalar differing.
MAZE_RUNS = (dict(seed=0), dict(seed=1, learning_rate=1e-3,
                                grad_clip_norm=0.5, weight_decay=1e-4, threshold=0.5,
                                discount=0.5, alpha0=2.0, beta0=0.25))
MAZE_COUNTED = ("rollouts/min", "rollouts/max", "active_fraction", "useful_group_fraction",
                "all_zero_group_fraction", "estimated_fraction", "reward/mean")


def _maze_alone(config):
  single = maze_task.MazeTask(config)
  state, rows = _train(single, single.init_state(jax.random.PRNGKey(config.seed)),
                       config.num_steps)
  return jax.device_get(state), rows


def _without_key_bias(name, params, dim):
  """`params` less the attention's key bias if `name` is the qkv bias: its gradient is 0 in
  exact arithmetic (a softmax over keys ignores a shift of them all), so Adam moves it by
  rounding noise scaled to the learning rate, differently in two programs."""
  if name.endswith("['qkv']['bias']"):
    return np.delete(params, np.s_[dim:2 * dim], axis=-1)
  return params


def _assert_same_maze_params(alone, together, dim, learning_rate):
  """Within 1e-5, but for the attention's key bias (`_without_key_bias`) and at most 0.5% of a
  leaf's elements: an element whose gradient is ~0 (as small as the two programs' rounding)
  is moved by Adam by up to its rate a step, in either direction; those stay within
  MAZE_STEPS * learning_rate."""
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(alone)[0], jax.tree.leaves(together),
                          strict=True):
    name = jax.tree_util.keystr(path)
    difference = np.abs(_without_key_bias(name, b, dim) - _without_key_bias(name, a, dim))
    assert np.mean(difference > 1e-5) <= 0.005, (name, np.sort(difference.ravel())[-8:])
    assert np.max(difference, initial=0) <= MAZE_STEPS * learning_rate, name


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sera", "uniform", "grpo"])
def test_each_maze_run_of_a_batch_is_the_run_alone(method):
  configs_ = [_maze_config(method, **run) for run in MAZE_RUNS]
  runs = maze_batched.BatchedMaze(configs_)
  states, rows = _train(runs, runs.init_state(), MAZE_STEPS)
  states = jax.device_get(states)
  for r, config in enumerate(configs_):
    state, alone_rows = _maze_alone(config)
    together_rows = [{key: value[r] for key, value in row.items()} for row in rows]
    for step, (alone, together) in enumerate(zip(alone_rows, together_rows, strict=True)):
      assert set(together) == set(alone)
      for key, value in alone.items():
        message = f"run {r}, step {step}, {key}"
        if key in MAZE_COUNTED:
          np.testing.assert_array_equal(together[key], value, err_msg=message)
        else:
          np.testing.assert_allclose(together[key], value, rtol=RTOL, atol=ATOL, err_msg=message)
    run = batching.run_state(states, r)
    # The historical estimator's counts and staged outcomes: the allocations' inputs, exact.
    jax.tree.map(np.testing.assert_array_equal, run.historical, state.historical)
    _assert_same_maze_params(state.params, run.params, config.dim, config.learning_rate)
  assert "rollouts/max" in rows[-1]
  # The last step allocated on the estimate of the first RL epoch (SERA's counts from it).
  np.testing.assert_array_equal(rows[-1]["estimated_fraction"], 1.0)
  # Every run solved mazes in its RL steps: its advantages and RL gradients were not all 0.
  assert np.all(np.max([row["reward/mean"] for row in rows[1:]], axis=0) > 0)
  if method == "sera":  # and SERA's counts were uneven
    assert np.max(rows[-1]["rollouts/max"]) > config.baseline_n
  first, second = (jax.tree.leaves(batching.run_state(states, r).params)[0] for r in (0, 1))
  assert not np.allclose(first, second)


@pytest.mark.parametrize("key,value", [("batch_size", 8), ("baseline_n", 8), ("n_max", 16),
                                       ("dim", 32), ("method", "grpo"), ("n_min", 3),
                                       ("data_seed", 1)])
def test_a_maze_key_outside_the_varied_ones_is_refused_by_name(key, value):
  configs_ = [_maze_config(seed=0), _maze_config(seed=1, learning_rate=1e-3, **{key: value})]
  with pytest.raises(ValueError, match=rf"^config\.{key} differs between runs .* run 1\); "
                                       r"the runs of a batch may differ only in seed, "):
    maze_batched.BatchedMaze(configs_)


@pytest.mark.slow
def test_the_sweep_benchmark_times_both_ways():
  """A smoke test of benchmarks/sweep.py (no timing is asserted)."""
  path = pathlib.Path(__file__).parents[1] / "benchmarks" / "sweep.py"
  spec = importlib.util.spec_from_file_location("sweep_benchmark", path)
  benchmark = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(benchmark)
  seconds = benchmark.measure("mlp", runs=2, steps=2, repeats=3)
  assert seconds["sequential_first"] > 0 and seconds["batched_first"] > 0
  for way in ("sequential_rounds", "batched_rounds"):
    assert len(seconds[way]) == 3 and all(value > 0 for value in seconds[way])
  large = benchmark._config("n0_1024", 1, 2)  # budget scaling's largest SERA run
  assert (large.baseline_n, large.n_max, large.seed) == (1024, 4096, 1)


def test_sweep_batches_the_runs_that_differ_in_varied_keys_alone(tmp_path, monkeypatch):
  batches, trained = [], []

  def run_batch(configs_, workdirs):
    batches.append(([c.seed for c in configs_], [c.learning_rate for c in configs_], workdirs))

  monkeypatch.setattr(harness_batched, "run_batch", run_batch)
  root = str(tmp_path)
  grid = ["--grid", "batch_size=16,32", "--grid", "seed=0,1", "--grid", "learning_rate=0.01,0.05",
          "--grid", "num_steps=2", "--workdir-root", root]
  runs = sweep.main(grid, trained.append)
  assert trained == []
  # One batch a batch_size (it changes shapes), its seeds and rates in the grid's order.
  assert [(seeds, rates) for seeds, rates, _ in batches] == [([0, 0, 1, 1],
                                                             [0.01, 0.05, 0.01, 0.05])] * 2
  assert [workdirs for _, _, workdirs in batches] == [[run.workdir for run in runs[:4]],
                                                      [run.workdir for run in runs[4:]]]
  # A run alone in its group, and every run with --one-by-one, trains as `sera-jax train`.
  sweep.main(["--grid", "batch_size=16,32", "--grid", "num_steps=2", "--workdir-root", root],
             trained.append)
  sweep.main([*grid, "--one-by-one"], trained.append)
  assert len(batches) == 2 and len(trained) == 2 + len(runs)
  assert trained[2:] == [run.train_args("default") for run in runs]


# Each setting's batch on a ("runs", "data") mesh of 8 fake CPU devices: its runs, and the
# size of the mesh's runs axis.
MESH_CASES = {"classification": (4, 4), "maze": (2, 2)}


def _mesh_batch(setting, mesh):
  if setting == "classification":
    configs_ = [_config(seed=seed, learning_rate=0.01 * (1 + seed)) for seed in range(4)]
    return batched.BatchedClassification(configs_, mesh), STEPS
  configs_ = [_maze_config(**run) for run in MAZE_RUNS]
  return maze_batched.BatchedMaze(configs_, mesh), MAZE_STEPS


def _train_on(setting, mesh):
  """(metrics of every step, final states, the states' leading shard size) of the batch."""
  runs, steps = _mesh_batch(setting, mesh)
  states, rows = _train(runs, runs.init_state(), steps)
  leaf = jax.tree.leaves(states.params)[0]
  return rows, jax.device_get(states), leaf.addressable_shards[0].data.shape[0]


def _mesh_main(setting, out):
  """In a process of 8 fake devices: the batch unsharded and on the mesh, into `out` (npz)."""
  assert jax.device_count() == 8
  _, runs_devices = MESH_CASES[setting]
  # The reference: the runs on one device (a mesh of one, as a single-device machine runs).
  plain_rows, plain, _ = _train_on(setting, batching.runs_mesh(1, jax.devices()[:1]))
  mesh_rows, sharded, shard_runs = _train_on(setting, batching.runs_mesh(runs_devices))
  arrays = {"shard_runs": np.asarray(shard_runs)}
  for name, rows in (("plain", plain_rows), ("mesh", mesh_rows)):
    arrays |= {f"{name}/{step}/{key}": value for step, row in enumerate(rows)
               for key, value in row.items()}
  for name, states in (("plain", plain), ("mesh", sharded)):
    arrays |= {f"{name}/params/{jax.tree_util.keystr(path)}": leaf
               for path, leaf in jax.tree_util.tree_flatten_with_path(states.params)[0]}
  np.savez(out, **arrays)


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["classification", "maze"])
def test_a_batch_split_over_a_runs_mesh_trains_as_on_one_device(setting, tmp_path):
  out = tmp_path / "result.npz"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      " --xla_force_host_platform_device_count=8").strip()
  subprocess.run([sys.executable, __file__, setting, str(out)], env=env, check=True,
                 timeout=900)
  result = dict(np.load(out))
  num_runs, runs_devices = MESH_CASES[setting]
  assert result.pop("shard_runs") == num_runs // runs_devices  # the runs were split
  plain = {key.removeprefix("plain/"): value for key, value in result.items()
           if key.startswith("plain/")}
  assert plain and len(plain) * 2 == len(result)
  for key, value in plain.items():
    if key.split("/", 1)[1] in COUNTED + MAZE_COUNTED:
      np.testing.assert_array_equal(result[f"mesh/{key}"], value, err_msg=key)
    elif key.startswith("params/") and setting == "maze":
      dim = _maze_config().dim
      np.testing.assert_allclose(_without_key_bias(key, result[f"mesh/{key}"], dim),
                                 _without_key_bias(key, value, dim), rtol=0, atol=1e-5,
                                 err_msg=key)
    else:
      np.testing.assert_allclose(result[f"mesh/{key}"], value, rtol=RTOL, atol=1e-5, err_msg=key)


if __name__ == "__main__":
  _mesh_main(*sys.argv[1:])
