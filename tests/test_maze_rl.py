"""Tests of maze RL: the rollout layout and the MazeTask protocol."""


import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from sera_jax.common import episodes
from sera_jax.harness import configs, train
from sera_jax.harness.figures import common as figures_common
from sera_jax.method import estimators
from sera_jax.settings.maze import env as maze_env
from sera_jax.settings.maze import plots as maze_plots
from sera_jax.settings.maze import sets as maze_sets
from sera_jax.settings.maze import task as maze_rl
from sera_jax.settings.maze import warm_start


def _config(**overrides):
  config = configs.load("maze")
  # Tiny: epochs of 2 steps, so SERA allocates from the second RL epoch on.
  config.update(dict(maze_size=9, num_train_mazes=8, batch_size=4, baseline_n=4, n_min=2,
                     n_max=8, num_eval_mazes=2, num_validation_mazes=0, eval_batch_size=2,
                     eval_samples=256, num_sft_mazes=16, sft_batch_size=8, dim=16,
                     num_layers=1, num_heads=2, num_steps=6) | overrides)
  return config


def test_maze_success_is_averaged_over_every_maze_of_the_batch():
  counts = jnp.asarray([4, 0, 2, 0])
  successes = jnp.asarray([1.0, 0.0, 2.0, 0.0])
  estimate = jnp.log(jnp.asarray([0.5, 0.9, 0.5, 0.02]))
  means = jax.device_get(episodes.success_means(counts, successes, estimate, prompt="maze"))
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
  return maze_rl.MazeTask(_config(method="sera", eval_every=6, checkpoint_every=3))


@pytest.mark.slow
def test_task_runs_with_static_shapes_and_resumes_exactly(sera_task):
  task = sera_task
  state = task.init_state(jax.random.PRNGKey(0))
  assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(state))
  rows, saved = [], None
  for step in range(task.config.num_steps):
    if step == 3:
      saved = jax.tree.map(np.array, state)
    state, metrics = task.train_step(state, step)
    rows.append(jax.device_get(metrics))
    assert all(np.isfinite(v) for v in rows[-1].values())
  # The first RL epoch (2 steps) is uniform; later epochs allocate from estimates.
  assert [row["estimated_fraction"] for row in rows[:3]] == [0.0, 0.0, 1.0]
  assert rows[0]["rollouts/std"] == 0.0
  # The allocation's p is the historical estimate (the Beta prior in the first RL epoch).
  assert all("p_estimate/mean" in row and "p/mean" not in row for row in rows)
  assert task._rl_step._cache_size() == 1  # counts changed, no retrace
  resumed = jax.tree.map(jnp.asarray, saved)
  for step in range(3, task.config.num_steps):
    resumed, metrics = task.train_step(resumed, step)
    assert jax.device_get(metrics) == rows[step]
  jax.tree.map(np.testing.assert_array_equal, resumed, state)
  scores = task.evaluate(state)
  assert set(scores) >= {f"pass@{k}" for k in task.ks} and task.ks[-1] == 256
  assert all(0 <= v <= 1 for v in scores.values())


@pytest.mark.slow
def test_microbatches_accumulate_the_same_gradient():
  params = []
  for microbatches in (1, 2):
    config = _config(method="grpo", microbatches=microbatches, optimizer="sgd", momentum=0.0,
                     learning_rate=1.0, grad_clip_norm=1e9)
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
  config = _config(method="sera", estimator="pkpo")
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
  stopped_early.num_steps = 4  # checkpoints at 3 and 4; the second run resumes from 4
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


def _path_rows(mazes, max_steps):
  paths = jax.vmap(lambda m: maze_env.shortest_path(m, max_steps)[0])(jnp.asarray(mazes))
  return [row.tobytes() for row in np.asarray(paths)]


def test_the_sets_share_no_maze_and_the_pool_no_path_counted_independently():
  max_steps = maze_env.max_path_length(9) + 1
  sets = maze_sets.maze_sets(0, 9, max_steps, 32, 16, 16, 48, True)
  assert [len(s.mazes) for s in (sets.sft, sets.rl, sets.held_out, sets.validation)] == [
      48, 32, 16, 16]
  assert sets.overlaps() == dict.fromkeys(("sft_rl", "sft_eval", "rl_eval",
                                           "held_out_validation"), 0)
  layouts = [row.tobytes() for s in sets[:4] for row in s.mazes]
  assert len(set(layouts)) == len(layouts)  # every maze of every set is distinct
  paths = {name: _path_rows(s.mazes, max_steps) for name, s in zip(
      ("sft", "rl", "held_out", "validation"), sets[:4], strict=True)}
  assert [row.tobytes() for row in sets.rl.paths] == paths["rl"]  # the stored paths are BFS's
  assert not set(paths["sft"]) & set(paths["rl"] + paths["held_out"] + paths["validation"])
  assert sets.sft.candidates > 48  # path-disjointness refused some candidates
  unseen = [path not in set(paths["rl"]) for path in paths["held_out"]]
  np.testing.assert_array_equal(sets.unseen_path, unseen)
  shared = sets.shared_paths()
  assert (shared["sft_rl"], shared["sft_eval"]) == (0, 0)
  assert shared["held_out_rl"] == 16 - sum(unseen) and 0 < sum(unseen) < 16  # i.i.d.: some
  # Each set has its own key: the RL and evaluation sets do not depend on the pool's size.
  other = maze_sets.maze_sets(0, 9, max_steps, 32, 16, 16, 8, False)
  for ours, theirs in zip(sets[1:4], other[1:4], strict=True):
    np.testing.assert_array_equal(ours.mazes, theirs.mazes)


def test_the_replay_baseline_is_exact():
  sets = maze_sets.maze_sets(0, 9, maze_env.max_path_length(9) + 1, 32, 16, 16, 48, True)
  # On the RL mazes: p_m = (RL mazes sharing m's path) / N.
  paths = [row.tobytes() for row in sets.rl.paths]
  p = np.array([paths.count(row) / len(paths) for row in paths])
  np.testing.assert_allclose(
      maze_sets.replay_pass_at_k(sets.rl.paths, sets.rl.mazes, ks=(1, 4)),
      [p.mean(), np.mean(1 - (1 - p) ** 4)], rtol=1e-6)
  # A maze has one shortest path: replay never solves a held-out maze whose path is unseen.
  np.testing.assert_array_equal(maze_sets.replay_pass_at_k(
      sets.rl.paths, sets.held_out.mazes[sets.unseen_path], ks=(1, 64)), 0)


def test_every_held_out_and_validation_maze_is_solvable_within_max_steps():
  """A max_steps below the longest path (16 on 9x9 mazes): mazes whose path needs more moves
  are not drawn."""
  sets = maze_sets.maze_sets(1, 9, 16, 16, 16, 16, 0, False)
  for mazes in (sets.rl.mazes, sets.held_out.mazes, sets.validation.mazes):
    lengths = jax.vmap(lambda m: maze_env.shortest_path(m, 31)[1])(jnp.asarray(mazes))
    assert len(mazes) == 16 and int(jnp.max(lengths)) <= 16


def test_the_warm_start_is_shared_by_every_seed_and_method_and_kept_on_disk(tmp_path):
  config = _config(num_sft_mazes=32, warm_start_dir=str(tmp_path))
  sera = maze_rl.MazeTask(config)
  grpo = maze_rl.MazeTask(_config(num_sft_mazes=32, warm_start_dir=str(tmp_path),
                                  method="grpo", seed=3))
  params = [task.init_state(jax.random.PRNGKey(seed)).params
            for task, seed in ((sera, 0), (grpo, 1))]
  digests = {warm_start.params_digest(p) for p in params}
  assert len(digests) == 1
  fresh = sera.policy.init(jax.random.PRNGKey(config.sft_seed))
  assert warm_start.params_digest(fresh) not in digests  # it was trained
  # It imitates: the pool's BFS paths are likelier under it than under its initialisation.
  nll = lambda p: -float(jnp.mean(sera.policy.log_prob(  # noqa: E731
      p, jnp.asarray(sera.sets.sft.mazes), jnp.asarray(sera.sets.sft.paths)[:, None])))
  assert nll(params[0]) < nll(fresh)
  saved = tmp_path / warm_start.fingerprint(config)
  assert saved.exists()
  warm_start._IN_PROCESS.clear()  # as another process: read back from disk, not retrained
  assert warm_start.params_digest(sera.warm_start()) in digests
  other = _config(num_sft_mazes=16)
  assert warm_start.fingerprint(other) != warm_start.fingerprint(config)
  assert warm_start.fingerprint(_config(num_sft_mazes=32, seed=5, method="uniform",
                                        learning_rate=3e-5)) == warm_start.fingerprint(config)


def test_evaluation_scores_the_sets_it_is_asked_for():
  both = maze_rl.MazeTask(_config(num_eval_mazes=4, num_validation_mazes=4, eval_samples=16))
  state = both.init_state(jax.random.PRNGKey(0))
  metrics = both.evaluate(state)
  assert {f"validation/pass@{k}" for k in (1, 2, 4, 8, 16)} <= set(metrics)
  assert {f"pass@{k}" for k in (1, 2, 4, 8, 16)} <= set(metrics)
  # Each set draws its own samples: one set's scores are those of a task scoring it alone.
  for name, prefix in (("validation", "validation/"), ("held_out", "")):
    alone = maze_rl.MazeTask(_config(num_eval_mazes=4, num_validation_mazes=4, eval_samples=16,
                                     eval_sets=(name,)))
    scores = alone.evaluate(alone.init_state(jax.random.PRNGKey(0)))
    assert scores == {key: value for key, value in metrics.items()
                      if key.startswith(prefix) and (prefix or "/" not in key
                                                     or key.startswith("unseen_path/"))}
  p = both.rl_set_success_rates(state.params, 8)
  assert p.shape == (8,) and np.all((p >= 0) & (p <= 1))
  with pytest.raises(ValueError, match="num_validation_mazes \\(3\\) must be a multiple"):
    maze_rl.MazeTask(_config(num_validation_mazes=3))
  with pytest.raises(ValueError, match="eval_sets"):
    maze_rl.MazeTask(_config(eval_sets=("test",)))
  with pytest.raises(ValueError, match="sees each once"):
    maze_rl.MazeTask(_config(num_sft_mazes=12))

def test_the_maze_figure_of_run_rows(tmp_path):
  rows = [{"step": s, "reward/maze_mean": s / 10} for s in range(10)]
  rows[-1] |= {f"pass@{k}": 0.1 * i for i, k in enumerate(episodes.pass_at_ks(256))}
  maze_plots.plot_runs([("sera", rows), ("uniform", rows[:5])], str(tmp_path / "maze.png"))
  assert (tmp_path / "maze.png").stat().st_size > 0


# The authors' maze/maze_17.sh (and their warm start, ckpt-1500), key by key
# (docs/training.md#maze17-against-the-authors-script).
MAZE17_AUTHORS = dict(
    maze_size=17, num_train_mazes=7424, batch_size=256, baseline_n=128, n_min=2, n_max=512,
    threshold=0.05, normalize_by_rollout_count=True, normalize_by_rho=False, alpha0=0.5,
    beta0=0.5, discount=0.75, learning_rate=1e-4, weight_decay=0.01, grad_clip_norm=1.0,
    num_steps=3000, num_sft_mazes=48000, sft_batch_size=32, sft_learning_rate=5e-4,
    num_eval_mazes=256, eval_samples=2048, eval_every=250, checkpoint_every=250, dim=256,
    num_layers=4, num_heads=4, method="sera", optimizer="adam")


def test_maze17_is_the_authors_script():
  config = configs.load("maze17")
  assert {key: config[key] for key in MAZE17_AUTHORS} == MAZE17_AUTHORS
  assert maze_rl.step_limit(config) <= 180  # their max_response_length
  maze_rl.validate_config(config)


@pytest.mark.slow
def test_maze17_trains_a_step_on_this_cpu(tmp_path):
  """The shipped config with its data and budget shrunk (its mazes and its policy kept): one
  SERA step and an evaluation through the training entry."""
  config = configs.load("maze17")
  config.update(dict(num_train_mazes=8, batch_size=4, baseline_n=2, n_max=8,
                     num_sft_mazes=32, num_eval_mazes=4, num_validation_mazes=4,
                     eval_batch_size=4, eval_samples=8, microbatches=1, num_steps=1,
                     eval_every=1, checkpoint_every=1))
  rows = train.run(config, str(tmp_path))
  assert [row["step"] for row in rows] == [0]
  assert np.isfinite(rows[-1]["loss"]) and 0 <= rows[-1]["pass@8"] <= 1
  assert "validation/pass@8" in rows[-1]
