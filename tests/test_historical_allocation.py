"""The allocation every setting shares: `registry.AllocationConfig`, the registry of modes and
`historical.historical_allocation`, and each setting's path through them."""

import functools
import types

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from absl.testing import parameterized

import sera_jax
from sera_jax.harness import configs
from sera_jax.harness.configs import base
from sera_jax.method import allocators, registry, success
from sera_jax.method.historical import historical_allocation
from sera_jax.settings.classification import allocations as classification
from sera_jax.settings.maze import task as maze

BOUNDS = dict(baseline_n=4, n_min=2, n_max=16)
NUM_PROMPTS = 12
IDS = np.array([0, 3, 5, 6, 8, 11], np.int32)  # the batch; prompt 5 was never rolled out


def _staged(state, ids):
  """`state` with prompt q's group of 8 rollouts staged: q % 9 successes, the rest failures."""
  ids = np.asarray(ids)
  rewards = (np.arange(8)[None, :] < (ids % 9)[:, None]).astype(np.float32)
  return success.historical_stage(state, ids, rewards, np.ones_like(rewards))


def _history():
  """One epoch folded: every prompt but 5 rolled out once, prompt q with q % 9 successes of 8."""
  rolled_out = [q for q in range(NUM_PROMPTS) if q != 5]
  return success.historical_start_epoch(_staged(success.historical_init(NUM_PROMPTS),
                                                rolled_out))


def _ruled_log_p(state):
  """The rule by hand: a prompt's own estimate, the mean p of the seen prompts where it has none."""
  successes, failures = (np.asarray(x, np.float64) for x in (state.successes, state.failures))
  seen = np.asarray(state.seen)
  estimate = (0.5 + successes) / (1.0 + successes + failures)
  log_p = np.log(estimate[IDS])
  log_p[~seen[IDS]] = np.log(estimate[seen].mean())
  return log_p


@pytest.mark.slow  # compiles SERA's and the baselines' allocations: 5-40 s
class HistoricalAllocationTest(parameterized.TestCase):

  def _step(self, config, *args, **kwargs):
    return self.variant(functools.partial(historical_allocation, config))(*args, **kwargs)

  @chex.variants(with_jit=True, without_jit=True)
  def test_an_unseen_prompt_gets_the_population_mean_and_the_batch_keeps_its_mode(self):
    config = registry.AllocationConfig(mode="sera", **BOUNDS)
    state = _history()
    got_state, alloc, log_p = self._step(config, state, IDS, False, True)
    want_log_p = _ruled_log_p(state)
    np.testing.assert_allclose(log_p, want_log_p, rtol=1e-6)
    np.testing.assert_array_equal(
        alloc.counts, sera_jax.allocate(log_p, mode="sera", **BOUNDS).counts)
    assert not (np.asarray(alloc.counts) == BOUNDS["baseline_n"]).all()
    chex.assert_trees_all_equal(got_state, state)  # no boundary: nothing folded

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("sera", "equalized", "knapsack")
  def test_uniform_while_nothing_is_seen_and_for_evaluation_batches(self, mode):
    config = registry.AllocationConfig(mode=mode, **BOUNDS)
    empty = _staged(success.historical_init(NUM_PROMPTS), range(NUM_PROMPTS))  # not folded
    _, alloc, log_p = self._step(config, empty, IDS, False, True)
    np.testing.assert_array_equal(alloc.counts, BOUNDS["baseline_n"])
    np.testing.assert_allclose(log_p, np.log(0.5), rtol=1e-6)  # the prior mean
    _, alloc, _ = self._step(config, _history(), IDS, False, False)
    np.testing.assert_array_equal(alloc.counts, BOUNDS["baseline_n"])
    np.testing.assert_array_equal(alloc.weights, 1.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_an_epoch_boundary_folds_the_staged_outcomes_before_allocating(self):
    config = registry.AllocationConfig(mode="sera", discount=0.5, **BOUNDS)
    staged = _staged(_history(), [5])  # prompt 5 is rolled out in the second epoch
    for new_epoch in (False, True):
      got_state, alloc, log_p = self._step(config, staged, IDS, new_epoch, True)
      want_state = success.historical_start_epoch(staged, discount=0.5) if new_epoch else staged
      chex.assert_trees_all_close(got_state, want_state, rtol=1e-6)
      np.testing.assert_allclose(log_p, _ruled_log_p(want_state), rtol=1e-6)
    assert bool(got_state.seen[5])
    np.testing.assert_allclose(log_p[2], np.log(5.5 / 9.0), rtol=1e-6)  # its own now

  @chex.variants(with_jit=True, without_jit=True)
  def test_a_given_log_p_is_allocated_on_and_the_history_still_kept(self):
    config = registry.AllocationConfig(mode="sera", **BOUNDS)
    oracle = jnp.log(jnp.linspace(0.02, 0.9, IDS.shape[0]))
    inputs = registry.AllocationInputs(log_p=oracle)
    empty = success.historical_init(NUM_PROMPTS)
    _, alloc, log_p = self._step(config, empty, IDS, False, True, inputs)
    np.testing.assert_array_equal(log_p, oracle)
    np.testing.assert_array_equal(alloc.counts,
                                  sera_jax.allocate(oracle, mode="sera", **BOUNDS).counts)
    _, alloc, _ = self._step(config, empty, IDS, False, False, inputs)
    np.testing.assert_array_equal(alloc.counts, BOUNDS["baseline_n"])
    staged = _staged(empty, IDS)
    folded, _, _ = self._step(config, staged, IDS, True, True, inputs)
    chex.assert_trees_all_close(folded, success.historical_start_epoch(staged), rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_a_baseline_on_the_history_reads_its_other_inputs(self):
    config = registry.AllocationConfig(mode="gvm", **BOUNDS)
    grad_norm = jnp.linspace(0.1, 2.0, IDS.shape[0])
    _, alloc, log_p = self._step(config, _history(), IDS, False, True,
                                 registry.AllocationInputs(grad_norm=grad_norm))
    np.testing.assert_array_equal(alloc.counts,
                                  allocators.gvm(log_p, grad_norm, **BOUNDS).counts)
    assert not (np.asarray(alloc.counts) == BOUNDS["baseline_n"]).all()


def test_a_mode_without_its_inputs_is_refused_by_name():
  config = registry.AllocationConfig(mode="gvm", **BOUNDS)
  with pytest.raises(ValueError, match=r"mode 'gvm' needs grad_norm \(each prompt's gradient"):
    historical_allocation(config, _history(), IDS, False, True)
  with pytest.raises(ValueError, match="needs outcomes"):
    registry.allocate_with(config.replace(mode="adaptive"),
                           registry.AllocationInputs(log_p=jnp.full(4, -1.0)))


# ----------------------------------------------------------------------------- the registry


@pytest.mark.slow  # compiles every allocator
def test_every_registered_mode_is_its_allocator():
  rng = np.random.default_rng(0)
  log_p = jnp.log(jnp.asarray(rng.uniform(0.01, 0.95, 10), jnp.float32))
  grad_norm = jnp.asarray(rng.uniform(0.1, 2.0, 10), jnp.float32)
  outcomes = jnp.asarray(rng.uniform(size=(10, 16)) < 0.3)
  inputs = registry.AllocationInputs(log_p, grad_norm, outcomes)
  want = {mode: sera_jax.allocate(log_p, mode=mode, **BOUNDS) for mode in sera_jax.MODES} | {
      "knapsack": allocators.knapsack(log_p, **BOUNDS),
      "gvm": allocators.gvm(log_p, grad_norm, **BOUNDS),
      "adaptive": allocators.adaptive(outcomes, log_p, round_size=registry.ROUND_SIZE, **BOUNDS),
  }
  assert set(want) == set(registry.MODES) == set(sera_jax.ALLOCATORS)
  for mode, alloc in want.items():
    got = registry.allocate_with(registry.AllocationConfig(mode=mode, **BOUNDS), inputs)
    chex.assert_trees_all_equal(got, alloc)
  assert [m for m in registry.MODES if registry.ALLOCATORS[m].outcome_dependent] == ["adaptive"]


def test_unknown_modes_are_rejected_with_the_registered_ones():
  with pytest.raises(ValueError, match=r"mode must be one of 'uniform', 'equalized', 'sera', "
                                       r"'knapsack', 'gvm', 'adaptive'; got 'greedy'"):
    registry.AllocationConfig(mode="greedy", **BOUNDS)
  with pytest.raises(ValueError, match="allocation must be one of"):
    registry.check_mode("ppo", name="allocation")


@pytest.mark.parametrize("change, error, message", [
    (dict(n_min=5), ValueError, "n_min must be <= baseline_n"),
    (dict(n_max=3), ValueError, "baseline_n must be <= n_max"),
    (dict(n_min=0), ValueError, "n_min must be >= 1"),
    (dict(baseline_n=4.0), TypeError, "baseline_n must be an int; got 4.0"),
    (dict(threshold=1.5), ValueError, r"threshold must lie in \[0, 1\]; got 1.5"),
    (dict(threshold=float("nan")), ValueError, "threshold must be finite"),
    (dict(normalize_by_rho="yes"), TypeError, "normalize_by_rho must be True or False"),
    (dict(round_size=0), ValueError, "round_size must be >= 1"),
    (dict(estimator="ppo"), ValueError, "estimator must be one of 'maxrl'"),
    (dict(discount=-0.1), ValueError, r"discount must lie in \[0, 1\]"),
    (dict(alpha0=0.0), ValueError, "alpha0 must be > 0"),
    (dict(beta0=-1.0), ValueError, "beta0 must be > 0"),
])
def test_the_config_rejects_bad_values(change, error, message):
  with pytest.raises(error, match=message):
    registry.AllocationConfig(**(BOUNDS | change))


def test_the_config_of_an_experiment_names_its_keys_and_hashes_by_value():
  experiment = ml_collections.ConfigDict(dict(BOUNDS, threshold=0.1, learning_rate=1e-3))
  config = registry.AllocationConfig.from_fields(experiment, mode="knapsack")
  assert config == registry.AllocationConfig(mode="knapsack", threshold=0.1, **BOUNDS)
  numpy_ints = registry.AllocationConfig(baseline_n=np.int64(4), n_min=2, n_max=np.int32(16))
  assert numpy_ints == registry.AllocationConfig(**BOUNDS)
  assert hash(numpy_ints) == hash(registry.AllocationConfig(**BOUNDS))
  assert (config.discount, config.alpha0, config.beta0) == (success.DISCOUNT, success.ALPHA0,
                                                            success.BETA0)
  assert config.max_count == 16 and config.replace(mode="uniform").max_count == 4
  with pytest.raises(ValueError, match=r"config.threshold must lie in \[0, 1\]"):
    registry.AllocationConfig.from_fields(experiment, prefix="config.", threshold=2.0)


def test_traced_scalars_allocate_as_the_same_values_given_as_numbers():
  """A batch of runs gives each run's threshold, discount and prior to one jitted step as
  arrays (`registry.SCALARS`): they allocate as the numbers do, and they matter."""
  state = _staged(_history(), IDS)  # outcomes staged: the discount folds at the boundary
  scalars = dict(threshold=0.6, discount=0.5, alpha0=2.0, beta0=0.25)

  @jax.jit
  def traced(values):
    return historical_allocation(registry.AllocationConfig(mode="sera", **BOUNDS).replace(
        **values), state, IDS, True, True)

  got = traced({name: jnp.float32(value) for name, value in scalars.items()})
  want = historical_allocation(registry.AllocationConfig(mode="sera", **BOUNDS, **scalars),
                               state, IDS, True, True)
  jax.tree.map(np.testing.assert_array_equal, got[0], want[0])  # the folded history
  np.testing.assert_array_equal(got[1].counts, want[1].counts)
  np.testing.assert_allclose(got[2], want[2], rtol=1e-6)
  default = historical_allocation(registry.AllocationConfig(mode="sera", **BOUNDS), state, IDS,
                                  True, True)
  assert not np.array_equal(default[1].counts, want[1].counts)
  assert not np.allclose(default[2], want[2])
  assert set(scalars) == set(registry.SCALARS)


# ----------------------------------------------------------------------------- the settings


def _maze_config(**changes):
  config = configs.load("maze")
  config.update(BOUNDS | changes)
  return config


@pytest.mark.parametrize("mode", ["knapsack", "uniform",
                                  pytest.param("sera", marks=pytest.mark.slow)])
def test_the_same_history_gives_the_same_counts_in_every_setting(mode):
  """The maze, the classification figures and the LLM learner allocate a batch with one unseen
  prompt by one rule: the same log p and the same counts."""
  from sera_jax.settings.llm import learner as llm  # Tunix: imported only here

  state = _history()
  logits = jnp.zeros((IDS.shape[0], 3))  # classification's other inputs: unread by these modes
  labels, key = jnp.zeros(IDS.shape[0], jnp.int32), jax.random.PRNGKey(0)
  maze_config = maze.allocation_config(_maze_config(method=mode))
  classification_config = classification.allocation_config(_classification(), mode)
  llm_config = llm.SeraConfig(num_generations=4, n_min=2, n_max=16, dataset_size=NUM_PROMPTS,
                              allocation=mode)
  assert maze_config == classification_config == llm_config.allocation_config
  paths = {
      "maze": historical_allocation(maze_config, state, IDS, False, True),
      "classification": classification.historical_allocation(
          classification_config, state, IDS, False, True, logits, labels, key),
      "llm": llm.SeraLearner._allocate_fn(types.SimpleNamespace(algo_config=llm_config),
                                          state, IDS, False, True, None),
  }
  want_log_p = _ruled_log_p(state)
  want = sera_jax.allocate_with(maze_config, sera_jax.AllocationInputs(
      jnp.asarray(want_log_p, jnp.float32))).counts
  for setting, (_, alloc, log_p) in paths.items():
    np.testing.assert_allclose(log_p, want_log_p, rtol=1e-6, err_msg=setting)
    np.testing.assert_array_equal(alloc.counts, want, err_msg=setting)
  assert mode == "uniform" or not (np.asarray(want) == BOUNDS["baseline_n"]).all()


def _classification(**changes):
  config = base.classification()
  config.update(BOUNDS | changes)
  return config


def test_the_maze_and_the_learner_refuse_the_modes_they_cannot_feed():
  from sera_jax.settings.llm import learner as llm  # Tunix: imported only here

  for method in ("grpo", "uniform", "equalized", "sera", "knapsack"):
    assert maze.allocation_config(_maze_config(method=method)).mode == method.replace(
        "grpo", "uniform")
  with pytest.raises(ValueError, match=r"'gvm' needs grad_norm .* which the maze cannot "
                                       r"provide; the maze can run 'uniform', 'equalized', "
                                       r"'sera', 'knapsack'"):
    maze.validate_config(_maze_config(method="gvm"))
  with pytest.raises(ValueError, match="'adaptive' needs outcomes .* which SeraLearner"):
    llm.SeraConfig(num_generations=4, n_max=16, dataset_size=8, allocation="adaptive")
  grpo = maze.allocation_config(_maze_config(method="grpo"))
  assert (grpo.mode, grpo.estimator) == ("uniform", "grpo")
