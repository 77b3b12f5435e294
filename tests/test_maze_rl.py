"""Tests of maze RL: the rollout layout and the MazeTask protocol."""


import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from sera_jax.harness import configs, train
from sera_jax.harness.figures import common as figures_common
from sera_jax.method import estimators
from sera_jax.settings.maze import env as maze_env
from sera_jax.settings.maze import plots as maze_plots
from sera_jax.settings.maze import task as maze_rl


def _config(**overrides):
  config = configs.load("maze")
  # Tiny: epochs of 2 steps, so SERA allocates from the second RL epoch on.
  config.update(dict(num_train_mazes=8, batch_size=4, baseline_n=4, n_min=2, n_max=8,
                     num_eval_mazes=2, eval_batch_size=2, dim=16, num_layers=1, num_heads=2,
                     warmup_steps=3, num_steps=9) | overrides)
  return config


def test_maze_success_is_averaged_over_every_maze_of_the_batch():
  counts = jnp.asarray([4, 0, 2, 0])
  successes = jnp.asarray([1.0, 0.0, 2.0, 0.0])
  estimate = jnp.log(jnp.asarray([0.5, 0.9, 0.5, 0.02]))
  means = jax.device_get(maze_rl.maze_success_means(counts, successes, estimate))
  # Measured where rolled out, the estimate where SERA gave no rollouts.
  np.testing.assert_allclose(means["reward/maze_mean"], (0.25 + 0.9 + 1.0 + 0.02) / 4, rtol=1e-6)
  np.testing.assert_allclose(means["reward/active_maze_mean"], (0.25 + 1.0) / 2, rtol=1e-6)


def test_bad_config_is_rejected():
  with pytest.raises(ValueError, match="method"):
    maze_rl.MazeTask(_config(method="ppo"))
  with pytest.raises(ValueError, match="multiple of"):
    maze_rl.MazeTask(_config(num_train_mazes=10))


@pytest.fixture(scope="module")
def sera_task():
  return maze_rl.MazeTask(_config(method="sera", eval_every=9, checkpoint_every=3))


@pytest.mark.slow
def test_task_runs_with_static_shapes_and_resumes_exactly(sera_task):
  task = sera_task
  state = task.init_state(jax.random.PRNGKey(0))
  assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(state))
  rows, saved = [], None
  for step in range(task.config.num_steps):
    if step == 6:
      saved = jax.tree.map(np.array, state)
    state, metrics = task.train_step(state, step)
    rows.append(jax.device_get(metrics))
    assert all(np.isfinite(v) for v in rows[-1].values())
  rl_rows = rows[task.config.warmup_steps:]
  # The first RL epoch (2 steps) is uniform; later epochs allocate from estimates.
  assert [row["estimated_fraction"] for row in rl_rows[:3]] == [0.0, 0.0, 1.0]
  assert rl_rows[0]["rollouts/std"] == 0.0
  # The allocation's p is the historical estimate (the Beta prior in the first RL epoch).
  assert all("p_estimate/mean" in row and "p/mean" not in row for row in rl_rows)
  assert task._rl_step._cache_size() == 1  # counts changed, no retrace
  resumed = jax.tree.map(jnp.asarray, saved)
  for step in range(6, task.config.num_steps):
    resumed, metrics = task.train_step(resumed, step)
    assert jax.device_get(metrics) == rows[step]
  jax.tree.map(np.testing.assert_array_equal, resumed, state)
  scores = task.evaluate(state)
  assert sorted(scores) == sorted(f"pass@{k}" for k in maze_rl.PASS_AT_K)
  assert all(0 <= v <= 1 for v in scores.values())


@pytest.mark.slow
def test_microbatches_accumulate_the_same_gradient():
  params = []
  for microbatches in (1, 2):
    config = _config(method="grpo", microbatches=microbatches, optimizer="sgd", momentum=0.0,
                     learning_rate=1.0, grad_clip_norm=1e9, warmup_steps=0)
    task = maze_rl.MazeTask(config)
    state, metrics = task.train_step(task.init_state(jax.random.PRNGKey(0)), 0)
    assert np.isfinite(float(metrics["loss"]))
    params.append(state.params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), *params)


@pytest.mark.slow
def test_sera_trains_with_a_peer_estimator_and_its_parameter():
  """config.estimator and config.estimator_kwargs reach the maze's allocation config, whose
  estimator the advantages take: pkpo (k=4) trains through the first RL epoch into SERA's
  counts with finite metrics."""
  config = _config(method="sera", warmup_steps=0, estimator="pkpo")
  config.estimator_kwargs = ml_collections.ConfigDict({"k": 4})
  task = maze_rl.MazeTask(config)
  assert task.allocation.estimator_spec == estimators.estimator_spec("pkpo", k=4)
  state = task.init_state(jax.random.PRNGKey(0))
  rows = []
  for step in range(3):
    state, metrics = task.train_step(state, step)
    rows.append(jax.device_get(metrics))
    assert all(np.isfinite(v) for v in rows[-1].values()), (step, rows[-1])
  assert [row["estimated_fraction"] for row in rows] == [0.0, 0.0, 1.0]


@pytest.mark.slow
def test_train_loop_resumes_with_identical_metrics(sera_task, tmp_path):
  config = sera_task.config
  uninterrupted = train.run(config, str(tmp_path / "a"), task=sera_task)
  stopped_early = config.copy_and_resolve_references()
  stopped_early.num_steps = 5  # checkpoints at 3 and 5; the second run resumes from 5
  train.run(stopped_early, str(tmp_path / "b"), task=sera_task)
  resumed = train.run(config, str(tmp_path / "b"), resume=True, task=sera_task)
  training_only = lambda rows: [{k: v for k, v in row.items() if "pass@" not in k}  # noqa: E731
                                for row in rows]
  assert training_only(resumed) == training_only(uninterrupted)
  assert resumed[-1] == uninterrupted[-1] and "pass@256" in resumed[-1]
  assert (tmp_path / "b" / "maze.png").exists()


@pytest.mark.slow
def test_a_task_reused_for_another_seed_trains_as_a_fresh_task_of_that_seed(sera_task, tmp_path):
  other_seed = sera_task.config.copy_and_resolve_references()
  other_seed.seed = 1
  train.run(sera_task.config, str(tmp_path / "seed0"), task=sera_task)  # compiles the steps
  compiled = sera_task._rl_step._cache_size(), sera_task._eval_successes._cache_size()
  reused = train.run(other_seed, str(tmp_path / "reused"),
                     task=figures_common.seeded(sera_task, other_seed))
  fresh = train.run(other_seed, str(tmp_path / "fresh"))
  assert reused == fresh
  # The copy ran on the first task's compiled steps, with no new trace.
  assert (sera_task._rl_step._cache_size(), sera_task._eval_successes._cache_size()) == compiled


def test_the_seed_orders_the_batches_and_data_seed_builds_the_mazes():
  first, other_seed = maze_rl.MazeTask(_config(seed=0)), maze_rl.MazeTask(_config(seed=1))
  orders = [[maze_rl.batch_ids(task.config, i, 0)[0].tolist() for i in range(4)]
            for task in (first, other_seed)]
  assert orders[0] != orders[1]
  np.testing.assert_array_equal(first.train_mazes, other_seed.train_mazes)
  np.testing.assert_array_equal(first.eval_mazes, other_seed.eval_mazes)


def test_held_out_solutions_never_occur_in_training_and_the_replay_baseline_is_exact():
  task = maze_rl.MazeTask(_config(num_eval_mazes=16, eval_batch_size=16))
  max_steps = task.train_paths.shape[1]
  held_paths = jax.vmap(lambda m: maze_env.shortest_path(m, max_steps)[0])(task.eval_mazes)
  seen = {row.tobytes() for row in np.asarray(task.train_paths)}
  assert not any(row.tobytes() in seen for row in np.asarray(held_paths))
  assert 0 < task.held_out.seen_fraction < 1 and task.held_out.candidates >= 16
  # Replaying training solutions never solves a maze whose only path is unseen...
  np.testing.assert_array_equal(maze_rl.replay_pass_at_k(task.train_paths, task.eval_mazes), 0)
  # ...and on the training mazes it is exact: p_m = (training mazes sharing m's path) / N.
  paths = [row.tobytes() for row in np.asarray(task.train_paths)]
  p = np.array([paths.count(row) / len(paths) for row in paths])
  np.testing.assert_allclose(
      maze_rl.replay_pass_at_k(task.train_paths, task.train_mazes, ks=(1, 4)),
      [p.mean(), np.mean(1 - (1 - p) ** 4)], rtol=1e-6)


def test_every_held_out_and_validation_maze_is_solvable_within_max_steps():
  """A config.max_steps below the longest path (16 on 9x9 mazes): training mazes are checked
  against it, and held-out and validation mazes whose path needs more moves are left out (the
  novelty filter used to keep exactly those: their cut-off paths match no training path)."""
  _, _, held_out, validation = maze_rl.maze_sets(1, 9, 16, 16, 16, 16, True)
  for mazes in (held_out.mazes, validation.mazes):
    lengths = jax.vmap(lambda m: maze_env.shortest_path(m, 31)[1])(mazes)
    assert len(mazes) == 16 and int(jnp.max(lengths)) <= 16


@pytest.mark.slow
def test_validation_mazes_share_no_path_with_training_or_held_out_mazes_and_are_scored():
  task = maze_rl.MazeTask(_config(num_eval_mazes=16, num_validation_mazes=16,
                                  eval_batch_size=16))
  assert task.validation_mazes.shape == (16, *task.eval_mazes.shape[1:])
  max_steps = task.train_paths.shape[1]
  paths = lambda mazes: {row.tobytes() for row in np.asarray(  # noqa: E731
      jax.vmap(lambda m: maze_env.shortest_path(m, max_steps)[0])(mazes))}
  validation = paths(task.validation_mazes)
  assert not validation & (paths(task.train_mazes) | paths(task.eval_mazes))
  state = task.init_state(jax.random.PRNGKey(0))
  metrics = task.evaluate(state)
  assert {f"validation/pass@{k}" for k in maze_rl.PASS_AT_K} <= set(metrics)
  # The held-out scores are those of a task without validation mazes.
  plain = maze_rl.MazeTask(_config(num_eval_mazes=16, eval_batch_size=16))
  assert plain.evaluate(plain.init_state(jax.random.PRNGKey(0))) == {
      key: value for key, value in metrics.items() if not key.startswith("validation/")}
  with pytest.raises(ValueError, match="num_validation_mazes \\(8\\) must be a multiple"):
    maze_rl.MazeTask(_config(num_eval_mazes=16, num_validation_mazes=8, eval_batch_size=16))


def test_the_maze_figure_of_run_rows(tmp_path):
  rows = [{"step": s, "reward/maze_mean": s / 10} for s in range(10)]
  rows[-1] |= {f"pass@{k}": 0.1 * i for i, k in enumerate(maze_rl.PASS_AT_K)}
  maze_plots.plot_runs([("sera", rows), ("uniform", rows[:5])], str(tmp_path / "maze.png"))
  assert (tmp_path / "maze.png").stat().st_size > 0
