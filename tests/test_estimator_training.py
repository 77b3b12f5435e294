"""The peers' estimators inside SERA's training loops: config keys `estimator` and
`estimator_kwargs` reach the advantages and the expected scale c(p, n) of every setting.

See docs/method.md#the-estimator-and-its-scale.
"""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from sera_jax.harness.configs import base
from sera_jax.harness.configs import maze as maze_config
from sera_jax.method import estimators, flat, registry
from sera_jax.settings.classification import allocations
from sera_jax.settings.classification.task import ClassificationTask
from sera_jax.settings.maze import task as maze_task

PEERS = [("pkpo", {"k": 4}), ("maclaurin", {"order": 8})]


def _classification_config(estimator, kwargs):
  config = base.classification()
  config.batch_size = 16
  config.warmup_steps = 0  # step 0 updates the parameters
  config.estimator = estimator
  config.estimator_kwargs = ml_collections.ConfigDict(kwargs)
  return config


def test_allocation_config_resolves_the_estimator_with_its_parameters():
  config = registry.AllocationConfig(baseline_n=4, n_max=16, estimator="pkpo",
                                     estimator_kwargs=ml_collections.ConfigDict({"k": 4}))
  assert config.estimator_kwargs == (("k", 4),)
  assert config.estimator_spec == estimators.estimator_spec("pkpo", k=4)
  assert hash(config) == hash(config.replace())  # a static jit argument still
  assert config != config.replace(estimator_kwargs={"k": 2})


@pytest.mark.parametrize(("estimator", "kwargs", "error", "match"), [
    ("nope", {}, ValueError, r"config\.estimator must be one of .*'maxrl'.*'pkpo'"),
    ("pkpo", {}, TypeError, r"config\.estimator_kwargs: .*needs .* k"),
    ("maxrl", {"k": 4}, TypeError, r"config\.estimator_kwargs: .*no parameter 'k'"),
])
def test_every_setting_refuses_an_unknown_estimator_or_parameter(estimator, kwargs, error,
                                                                 match):
  classification, maze = base.classification(), maze_config.get_config()
  for config in (classification, maze):
    config.estimator = estimator
    config.estimator_kwargs = ml_collections.ConfigDict(kwargs)
  with pytest.raises(error, match=match):
    allocations.allocation_config(classification, "sera")
  with pytest.raises(error, match=match):
    maze_task.allocation_config(maze)


def test_estimator_kwargs_must_be_a_mapping():
  with pytest.raises(TypeError, match=r"estimator_kwargs must be a mapping .*; got 4"):
    registry.AllocationConfig(baseline_n=4, n_max=16, estimator_kwargs=4)


def test_the_maze_takes_any_estimator_and_grpo_keeps_its_own():
  config = maze_config.get_config()
  assert maze_task.allocation_config(config).estimator_spec == estimators.estimator_spec("maxrl")
  config.method = "grpo"
  assert maze_task.allocation_config(config).estimator == "grpo"
  config.method, config.estimator = "uniform", "pkpo"
  config.estimator_kwargs = ml_collections.ConfigDict({"k": 4})
  assert maze_task.allocation_config(config).estimator_spec == estimators.estimator_spec(
      "pkpo", k=4)
  config.method = "grpo"
  with pytest.raises(ValueError, match=r"config\.method 'grpo' scores with GRPO's"):
    maze_task.allocation_config(config)


@pytest.mark.slow  # compiles two classification steps: ~10 s here
@pytest.mark.parametrize(("estimator", "kwargs"), PEERS)
def test_a_classification_step_trains_with_a_peer_estimator(estimator, kwargs):
  """One aligned SERA step on the digits: finite metrics, and the expected SERA gradient is
  the one of the estimator's own c(p, n) (its norm moves with the parameter)."""
  metrics = {}
  for value in (kwargs, {key: value // 2 for key, value in kwargs.items()}):
    task = ClassificationTask(_classification_config(estimator, value))
    state = task.init_state(jax.random.PRNGKey(0))
    before = jax.device_get(state.params)  # the step donates the state
    new_state, step_metrics = task.train_step(state, 0)
    metrics[tuple(value.items())] = jax.device_get(step_metrics)
    moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), jax.device_get(
        new_state.params), before)
    assert max(jax.tree.leaves(moved)) > 0
  first, halved = metrics.values()
  assert all(np.isfinite(value) for value in first.values()), first
  assert first["cos/sera_expected"] > 0.5, first
  assert first["norm_ratio/sera_expected"] != halved["norm_ratio/sera_expected"]


# --- SeraLearner: one step of the tiny Tunix setup of tests/test_llm.py -----------------------


@pytest.mark.slow  # builds and runs a Tunix cluster: 10-40 s here
@pytest.mark.parametrize(("estimator", "kwargs"), PEERS)
def test_a_sera_learner_step_trains_with_a_peer_estimator(estimator, kwargs):
  """On SERA's uneven counts, the learner's advantages are the estimator's flat advantages
  with its parameters, and the loss and its gradient are finite."""
  # The [llm] extra's helpers.
  from test_llm import N0, TRAIN, M, _in_epoch_two, _loss_and_grads, _prepared

  from sera_jax.settings.llm import learner as sera_llm
  from sera_jax.settings.llm import tiny

  cluster = tiny.cluster(1)
  config = sera_llm.SeraConfig(num_generations=N0, n_max=tiny.N_MAX,
                               dataset_size=tiny.DATASET_SIZE, estimator=estimator,
                               estimator_kwargs=kwargs)
  learner = _in_epoch_two(_prepared(sera_llm.SeraLearner(cluster, config, tiny.slack_reward)))
  batch = tiny.dataset(1, M)[0]
  with jax.set_mesh(tiny.mesh()):
    (example,) = learner._process_accumulated_batches([batch], [M], TRAIN)
    loss, grads = _loss_and_grads(cluster, learner, example)
  counts, rewards = learner.last_counts, learner.last_rewards
  assert not (counts == N0).all() and 0 < rewards.mean() < 1
  segments = np.repeat(np.arange(M), counts)
  want = flat.flat_advantages(jnp.asarray(rewards), jnp.asarray(segments), num_prompts=M,
                              estimator=estimator, **kwargs)
  assert np.abs(want).max() > 0
  # The trained advantages are w_q A_i, SERA's weights w_q = N0 / n_q.
  np.testing.assert_allclose(example.advantages, (N0 / counts)[segments] * want, rtol=1e-5,
                             atol=1e-7)
  assert np.isfinite(float(loss)) and all(np.isfinite(g).all() for g in grads)
