"""The simulation setting: scenarios as prompts, episodes as rollouts, success as the reward."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sera_jax.harness import batched, configs, train
from sera_jax.method import registry, scaling
from sera_jax.settings.sim import env as sim_env
from sera_jax.settings.sim import one_step
from sera_jax.settings.sim import task as sim_task


def _config(environment="one_step", **overrides):
  config = configs.load("sim_nav")
  with config.unlocked():
    config.environment = environment
    config.num_train_scenarios, config.batch_size, config.baseline_n = 8, 4, 4
    config.n_max, config.num_validation_scenarios, config.num_eval_scenarios = 8, 4, 4
    config.hidden_sizes, config.eval_samples, config.eval_batch_size = (8,), 8, 4
    config.update(overrides)
  return config


def test_the_estimator_is_kappa_times_the_exact_likelihood_gradient_in_expectation():
  """Monte Carlo over the episodes of one batch with SERA's counts: the mean gradient of the
  loss is -(1 / (M N0)) sum_q w_q n_q kappa(p_q, n_q) grad log p_q, with p exact."""
  config = _config(hidden_sizes=(4,), batch_size=4, baseline_n=4)
  task = sim_task.SimTask(config)
  params = task.policy.init(jax.random.PRNGKey(3))
  ids = jnp.arange(4, dtype=jnp.int32)
  keys = jax.vmap(lambda i: sim_env.scenario_key(config.data_seed, i))(ids)
  log_p = one_step.success_log_prob(task.policy, params, keys)
  alloc = registry.allocate_with(task.allocation, registry.AllocationInputs(log_p=log_p))
  counts = np.asarray(alloc.counts)
  assert counts.sum() == 16 and len(set(counts.tolist())) > 1  # unequal counts

  grad_log_p = jax.jacobian(lambda p: one_step.success_log_prob(task.policy, p, keys))(params)
  scale = -(alloc.weights * alloc.counts * scaling.fidelity(log_p, alloc.counts)) / 16
  expected = jax.tree.map(lambda g: jnp.tensordot(scale, g, axes=1), grad_log_p)

  samples = jax.jit(jax.vmap(lambda key: task.policy_gradient(params, ids, alloc, key)[0]))(
      jax.random.split(jax.random.PRNGKey(0), 20000))
  for name, leaf in jax.tree_util.tree_leaves_with_path(samples):
    mean, error = leaf.mean(0), leaf.std(0) / np.sqrt(leaf.shape[0])
    want = np.asarray(jax.tree_util.tree_flatten_with_path(expected)[0][
        [path for path, _ in jax.tree_util.tree_flatten_with_path(expected)[0]].index(name)][1])
    assert np.all(np.abs(mean - want) <= 5 * error + 1e-7), jax.tree_util.keystr(name)


def test_each_scenario_runs_its_count_of_episodes_in_the_flat_buffer():
  config = _config(method="uniform")
  task = sim_task.SimTask(config)
  params = task.policy.init(jax.random.PRNGKey(0))
  ids = jnp.array([5, 2, 7, 0], jnp.int32)
  counts = jnp.array([1, 6, 2, 7])
  alloc = registry.allocate_with(task.allocation, registry.AllocationInputs(
      log_p=jnp.log(jnp.full(4, 0.3))))._replace(counts=counts, weights=4 / counts)
  _, outcome = task.policy_gradient(params, ids, alloc, jax.random.PRNGKey(1))
  np.testing.assert_array_equal(np.bincount(outcome["prompt"], minlength=4), counts)
  # Episode b of prompt q ran scenario ids[q]: its observation is that scenario's threshold.
  observations, _, _ = task.episodes(params, ids[outcome["prompt"]], jax.random.PRNGKey(1))
  thresholds = jax.vmap(lambda i: one_step.reset(sim_env.scenario_key(0, i)).obs)(ids)
  np.testing.assert_array_equal(observations[:, 0], thresholds[outcome["prompt"]])


def test_sets_are_disjoint_and_batches_cover_the_training_scenarios_each_epoch():
  config = _config()
  sets = sim_task.scenario_sets(config)
  assert [sets[name].tolist() for name in ("train", "validation", "held_out")] == [
      list(range(8)), [8, 9, 10, 11], [12, 13, 14, 15]]
  epoch = np.concatenate([sim_task.batch_ids(config, i)[0] for i in range(2)])
  assert sorted(epoch.tolist()) == list(range(8))
  assert [sim_task.batch_ids(config, i)[1] for i in range(4)] == [False, False, True, False]


def test_a_run_trains_evaluates_and_resumes_exactly(tmp_path):
  config = _config(num_steps=4, eval_every=2, checkpoint_every=2, learning_rate=0.05)
  straight = train.run(config, str(tmp_path / "straight"))
  with config.unlocked():
    config.num_steps = 2
  train.run(config, str(tmp_path / "resumed"))
  with config.unlocked():
    config.num_steps = 4
  resumed = train.run(config, str(tmp_path / "resumed"), resume=True)
  last = lambda rows: {k: v for k, v in rows[-1].items() if not k.startswith("time")}  # noqa: E731
  assert last(straight) == last(resumed)
  assert {"pass@1", "pass@8", "validation/pass@1", "rollouts/max", "budget/hard_fraction",
          "reward/scenario_mean"} <= set(straight[-1])
  assert all(np.isfinite(row["loss"]) for row in straight if "loss" in row)


@pytest.mark.slow  # MJX compiles its step for 30 s
def test_the_mjx_point_mass_has_the_suites_interface_and_spreads_p():
  pytest.importorskip("mujoco.mjx", reason="the [sim] extra installs MuJoCo MJX")
  from mujoco import mjx

  from sera_jax.settings.sim import point_mass
  suite_env = point_mass.PointMass()
  environment = sim_env.from_suite(suite_env, success=point_mass.reached, horizon=20)
  assert sim_env.check(environment) == (7,)
  config = _config("point_mass", num_steps=2, eval_every=2, eval_samples=4)
  task = sim_task.SimTask(config, environment=environment)
  state = task.init_state(jax.random.PRNGKey(0))
  state, metrics = task.train_step(state, 0)
  assert np.isfinite(float(metrics["loss"])) and float(metrics["rollouts/max"]) == 4
  # A policy that heads for the goal: near scenarios succeed, those behind the wall rarely.
  def head_for_the_goal(env):
    reset = jax.vmap(env.reset)(jax.vmap(lambda i: sim_env.scenario_key(0, i))(
        jnp.arange(64)))
    return reset, jax.jit(lambda s: jax.lax.fori_loop(0, 40, lambda _, s: jax.vmap(env.step)(
        s, jnp.clip(4 * s.obs[:, 4:6], -1, 1)), s))(reset)
  reset, final = head_for_the_goal(suite_env)
  reached = np.asarray(jax.vmap(point_mass.reached)(final))
  same_side = np.sign(reset.data.qpos[:, 0]) == np.sign(reset.goal[:, 0])
  assert reached[same_side].mean() > 0.5 and reached[~same_side].mean() < reached[
      same_side].mean()
  # The solver's capped iterations leave the trajectories as MuJoCo's default limits give
  # them, walls and gap contacts included.
  default_solver = point_mass.PointMass()
  default_solver.mj_model.opt.iterations, default_solver.mj_model.opt.ls_iterations = 100, 50
  default_solver.model = mjx.put_model(default_solver.mj_model)
  _, final_default = head_for_the_goal(default_solver)
  np.testing.assert_allclose(final.data.qpos, final_default.data.qpos, atol=1e-5)
  # Some episodes end pressed against the middle wall (half-width 0.05, the ball's radius 0.05).
  assert np.any(np.abs(np.asarray(final.data.qpos[:, 0])) < 0.1 + 1e-3)


@dataclasses.dataclass
class _NoStep:
  action_size: int = 2

  def reset(self, key):
    return one_step.reset(key)


def test_bad_environments_get_one_line_errors():
  with pytest.raises(TypeError, match="has no step: a simulation setting needs reset"):
    sim_env.from_suite(_NoStep(), success=one_step.succeeded, horizon=1)
  good = one_step.environment()
  with pytest.raises(TypeError, match="success predicate must return a scalar bool; got "
                                      "float32"):
    sim_env.check(dataclasses.replace(good, success=lambda s: s.action[0] - s.obs[0]))
  with pytest.raises(ValueError, match="horizon must be >= 1"):
    sim_env.check(dataclasses.replace(good, horizon=0))
  with pytest.raises(TypeError, match="the observation must be a float vector"):
    sim_env.check(dataclasses.replace(good, observe=lambda s: s.obs.astype(jnp.int32)))
  with pytest.raises(TypeError, match="does not fit reset"):
    sim_env.check(dataclasses.replace(good, observe=lambda s: s.position))
  with pytest.raises(ValueError, match="config.environment must be one of"):
    sim_task.SimTask(_config("cartpole"))
  with pytest.raises(ValueError, match="num_train_scenarios .8. must be a multiple"):
    sim_task.SimTask(_config(batch_size=3))
  task = sim_task.SimTask(_config())
  params = task.policy.init(jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match=r"integers in \[0, 4\) of the held_out set; got 0 .. 4"):
    task.success_rates(params, "held_out", [0, 4], 2, jax.random.PRNGKey(0))
  rates = task.success_rates(params, "train", [0, 7], 64, jax.random.PRNGKey(0))
  assert rates.shape == (2,) and np.all((rates >= 0) & (rates <= 1))


def test_each_run_of_a_batch_is_the_run_alone(tmp_path):
  """Two runs (other seed, other rate) as one program: each run's rows are those it writes
  alone, up to the rounding of batched arithmetic."""
  runs = [_config(method="sera", num_steps=4, eval_every=4, checkpoint_every=4, seed=seed,
                  learning_rate=rate) for seed, rate in ((0, 0.01), (1, 0.03))]
  together = batched.run_batch(runs, [str(tmp_path / f"batch{r}") for r in range(2)])
  for r, config in enumerate(runs):
    alone = train.run(config, str(tmp_path / f"alone{r}"))
    assert len(alone) == len(together[r]) == 4
    for row_alone, row_together in zip(alone, together[r], strict=True):
      for key, value in row_alone.items():
        if not key.startswith("time"):
          np.testing.assert_allclose(row_together[key], value, rtol=1e-4, atol=1e-5,
                                     err_msg=key)


@pytest.mark.slow  # Playground compiles its physics for a minute
def test_a_mujoco_playground_environment_trains_through_the_adapter():
  """MuJoCo Playground's PointMass (DM Control Suite) through `from_suite`: its reset keyed by
  the scenario, success its reward's tolerance reached at the last step."""
  playground = pytest.importorskip("mujoco_playground",
                                   reason="the [sim] extra installs MuJoCo Playground")
  suite_env = playground.registry.load("PointMass")
  environment = sim_env.from_suite(suite_env, success=lambda state: state.reward > 0.5,
                                   horizon=10)
  assert sim_env.check(environment) == (suite_env.observation_size,)
  task = sim_task.SimTask(_config("point_mass", num_steps=2), environment=environment)
  state = task.init_state(jax.random.PRNGKey(0))
  for step in range(2):
    state, metrics = task.train_step(state, step)
    assert np.isfinite(float(metrics["loss"]))
  assert set(task.evaluate(state)) >= {"pass@1", "pass@8", "validation/pass@1"}
