"""SERA over simulated scenarios: a scenario is a prompt, an episode a rollout, success the reward.

A run trains a Gaussian policy (`sera_jax.settings.sim.policy`) in an environment
(`sera_jax.settings.sim.env`; `config.environment` names one of `ENVIRONMENTS`) on a fixed set
of training scenarios, ids 0 .. num_train_scenarios - 1 of the generator `config.data_seed`,
visited in epochs of shuffled batches of M scenarios; every step runs the same budget of
B = M * N0 episodes. Validation and held-out scenarios are the ids after them: draws of the
same generator, i.i.d. and disjoint from the training set by id. The methods and their
allocation are the maze's (both from `sera_jax.common.episodes`): "uniform" (centered MaxRL,
or `config.estimator`), "grpo", "sera" and the registered modes fed by log p, each on the
historical estimate of p (`sera_jax.method.historical.historical_allocation`).

Episodes live in a flat buffer of exactly B slots with segment ids (the scenario of each
episode, `sera_jax.method.flat`), vmapped with static shapes; the policy gradient is
sum_b coef_b grad log pi(tau_b) with coef the gradient of the loss of
docs/method.md#weights-and-the-loss in each episode's log-probability
(docs/method.md#simulated-scenarios), recomputed from the stored observations and actions:
the gradient never passes through the simulator.

Evaluation scores pass@k (k = 1, 2, 4, ... to config.eval_samples, unbiased) over the
held-out scenarios ("pass@k") and the validation ones ("validation/pass@k"). Batches, epochs
and RNG depend only on the step number, so the state is all a resume needs. On a device mesh
the B episodes of a step and an evaluation's episodes are split along "data".
"""

import functools
import importlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from sera_jax.common import episodes, optim, sharding
from sera_jax.common.evaluation import pass_at_k
from sera_jax.method import allocation, flat, registry, success, validation
from sera_jax.method.historical import historical_allocation
from sera_jax.settings.sim import env as sim_env
from sera_jax.settings.sim.policy import GaussianPolicy

# config.environment -> "module:function" returning an `Environment` (built on first use, so
# MuJoCo is imported only by the environments that need it).
ENVIRONMENTS = {"point_mass": "sera_jax.settings.sim.point_mass:environment",
                "one_step": "sera_jax.settings.sim.one_step:environment"}
EVAL_SETS = ("held_out", "validation")
SETS = ("train", "validation", "held_out")  # consecutive id ranges of one generator
HARD_P = 0.1  # a scenario is hard while its estimated p is below this ("budget/hard_fraction")
RL_ORDER = 3  # seeds the batch order with the run's seed and data_seed
_EVAL_KEY, _VALIDATION_KEY = 4, 6  # folded into the run's rng for each set's episodes


def make_environment(name: str) -> sim_env.Environment:
  """The environment `name` of `ENVIRONMENTS`."""
  validation.choice("config.environment", name, tuple(ENVIRONMENTS))
  module, function = ENVIRONMENTS[name].split(":")
  return getattr(importlib.import_module(module), function)()


class SimState(NamedTuple):
  """Everything a simulation run needs to resume exactly."""
  params: Any
  opt_state: Any
  rng: jax.Array
  historical: success.HistoricalState


def allocation_config(config: ml_collections.ConfigDict) -> registry.AllocationConfig:
  """`episodes.allocation_config` of the simulation setting."""
  return episodes.allocation_config(config, setting="a simulated scenario")


# Clipped Adam(W) or SGD at the constant rate config.learning_rate.
make_optimizer = episodes.make_optimizer


def validate_config(config: ml_collections.ConfigDict, num_devices: int = 1) -> None:
  """Rejects a bad config (for a mesh of `num_devices`) before anything is compiled."""
  allocation_config(config)
  validation.choice("config.environment", config.environment, tuple(ENVIRONMENTS))
  validation.integer("config.data_seed", config.data_seed, minimum=0)
  batch = validation.integer("config.batch_size", config.batch_size, minimum=1)
  train = validation.integer("config.num_train_scenarios", config.num_train_scenarios,
                             minimum=1)
  if train % batch:
    raise ValueError(f"config.num_train_scenarios ({train}) must be a multiple of "
                     f"config.batch_size ({batch}): epochs are whole batches.")
  sharding.check_batch_divisible("the episodes of a step, batch_size * baseline_n,",
                                 batch * config.baseline_n, num_devices)
  validation.choice("config.optimizer", config.optimizer, optim.OPTIMIZERS)
  for name in ("learning_rate", "grad_clip_norm"):
    validation.real(f"config.{name}", config[name], positive=True)
  validation.real("config.init_log_std", config.init_log_std)
  for width in config.hidden_sizes:
    validation.integer("config.hidden_sizes", width, minimum=1)
  validation.integer("config.eval_samples", config.eval_samples, minimum=1)
  for name in config.eval_sets:
    validation.choice("config.eval_sets", name, EVAL_SETS)
  eval_batch = validation.integer("config.eval_batch_size", config.eval_batch_size, minimum=1)
  for name in ("num_eval_scenarios", "num_validation_scenarios"):
    if validation.integer(f"config.{name}", config[name], minimum=0) % eval_batch:
      raise ValueError(f"config.{name} ({config[name]}) must be a multiple of "
                       f"config.eval_batch_size ({eval_batch}).")
  sharding.check_batch_divisible("config.eval_batch_size * config.eval_samples",
                                 eval_batch * config.eval_samples, num_devices)


def batch_ids(config: ml_collections.ConfigDict, index: int) -> tuple[np.ndarray, bool]:
  """Scenario ids of the index-th batch of shuffled epochs, and whether it opens an epoch > 0."""
  per_epoch = config.num_train_scenarios // config.batch_size
  epoch, position = divmod(index, per_epoch)
  permutation = np.random.default_rng(
      [config.seed, config.data_seed, RL_ORDER, epoch]).permutation(config.num_train_scenarios)
  ids = permutation[position * config.batch_size:(position + 1) * config.batch_size]
  return ids.astype(np.int32), position == 0 and epoch > 0


def scenario_sets(config: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
  """The scenario ids of each set: "train", then "validation", then "held_out"."""
  sizes = {"train": config.num_train_scenarios, "validation": config.num_validation_scenarios,
           "held_out": config.num_eval_scenarios}
  starts = np.cumsum([0, *sizes.values()])
  return {name: np.arange(start, start + size, dtype=np.int32)
          for (name, size), start in zip(sizes.items(), starts, strict=False)}


class SimTask:
  """The `sera_jax.harness.train.Task` of a simulation setting."""

  def __init__(self, config: ml_collections.ConfigDict, *, mesh=None, environment=None,
               optimizer=None):
    """A task of `config` on `mesh` (default: every device on "data") in `environment`
    (default `make_environment(config.environment)`; any `sim.env.Environment`)."""
    self.mesh = sharding.make_mesh() if mesh is None else mesh
    validate_config(config, self.mesh.shape[sharding.DATA_AXIS])
    self.config = config
    self.allocation = allocation_config(config)
    self.environment = (make_environment(config.environment) if environment is None
                        else environment)
    (observation_size,) = sim_env.check(self.environment)
    self.policy = GaussianPolicy(observation_size, self.environment.action_size,
                                 tuple(config.hidden_sizes), config.init_log_std)
    self.sets = scenario_sets(config)
    self.eval_ids = {name: sharding.replicate(jnp.asarray(ids), self.mesh)
                     for name, ids in self.sets.items()}
    self.ks = episodes.pass_at_ks(config.eval_samples)
    # Clipped Adam(W) or SGD at the constant rate config.learning_rate, as the maze's.
    self.optimizer = make_optimizer(config) if optimizer is None else optimizer
    self._rl_step = jax.jit(self.rl_step_fn)
    self._eval_successes = jax.jit(self.eval_successes_fn,
                                   out_shardings=sharding.replicated(self.mesh))

  # ---- protocol -------------------------------------------------------------------------------

  def init_state(self, rng: jax.Array) -> SimState:
    params = self.policy.init(jax.random.fold_in(rng, 0))
    state = SimState(params, self.optimizer.init(params), rng,
                     success.historical_init(self.config.num_train_scenarios))
    return sharding.replicate(state, self.mesh)

  def train_step(self, state: SimState, step: int) -> tuple[SimState, dict[str, jax.Array]]:
    ids, new_epoch = batch_ids(self.config, step)
    return self._rl_step(state, sharding.replicate(ids, self.mesh), step, new_epoch)

  def evaluate(self, state: SimState) -> dict[str, float]:
    """pass@k on the sets of config.eval_sets (see the module docstring)."""
    successes = functools.partial(self._eval_successes, state.params, state.rng)
    return {name: float(values[0]) for name, values in
            self.pass_at_k(lambda *args: successes(*args)[None]).items()}

  def pass_at_k(self, successes) -> dict[str, np.ndarray]:
    """{"pass@k", "validation/pass@k": [R]} of the sets of config.eval_sets for R policies
    whose successes on the eval_batch_size scenarios of `ids` from `start` are
    `successes(ids, start, key_tag)` (as `eval_successes_fn` counts them for one)."""
    metrics, batch = {}, self.config.eval_batch_size
    for name, prefix, tag in (("held_out", "", _EVAL_KEY),
                              ("validation", "validation/", _VALIDATION_KEY)):
      ids = self.eval_ids[name]
      if name not in self.config.eval_sets or not ids.shape[0]:
        continue
      counts = np.concatenate(jax.device_get(
          [successes(ids, start, tag) for start in range(0, ids.shape[0], batch)]), axis=1)
      values = np.stack([pass_at_k(run, self.config.eval_samples, self.ks) for run in counts])
      metrics |= {f"{prefix}pass@{k}": values[:, i] for i, k in enumerate(self.ks)}
    return metrics

  def success_rates(self, params, set_name: str, ids, num_samples: int, key: jax.Array
                    ) -> np.ndarray:
    """float64 [len(ids)]: the success rate among `num_samples` episodes of each scenario of
    the set `set_name` ("train", "validation" or "held_out") whose positions in the set are
    `ids`, under the policy `params`.

    Raises:
      ValueError: an unknown set, or a position out of the set's range.
    """
    validation.choice("set_name", set_name, SETS)
    ids = np.asarray(ids)
    size = self.sets[set_name].size
    if ids.size and (not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0
                     or ids.max() >= size):
      raise ValueError(f"scenario positions must be integers in [0, {size}) of the "
                       f"{set_name} set; got {ids.min()} .. {ids.max()}.")
    scenarios = jnp.repeat(jnp.asarray(self.sets[set_name][ids]), num_samples)
    _, _, rewards = jax.jit(self.episodes)(params, scenarios, key)
    return np.asarray(rewards, np.float64).reshape(-1, num_samples).mean(axis=1)

  def write_figures(self, workdir: str, rows: list[dict]) -> None:
    """Nothing beyond the metrics and TensorBoard."""

  # ---- steps ----------------------------------------------------------------------------------

  def episodes(self, params, scenario_ids: jax.Array, key: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One episode of each scenario of `scenario_ids` [E]; episode e draws its actions from
    fold_in(key, e). Returns (observations [E, T, obs], actions [E, T, act], rewards [E])."""
    action_keys = jax.vmap(functools.partial(jax.random.fold_in, key))(
        jnp.arange(scenario_ids.shape[0]))
    observations, actions, successes = jax.vmap(
        lambda scenario, action_key: self.policy.run_episode(
            params, self.environment, sim_env.scenario_key(self.config.data_seed, scenario),
            action_key))(scenario_ids, action_keys)
    return observations, actions, successes.astype(jnp.float32)

  def policy_gradient(self, params, ids: jax.Array, alloc: allocation.Allocation,
                      key: jax.Array) -> tuple[Any, dict[str, jax.Array]]:
    """The gradient of the loss of docs/method.md#weights-and-the-loss on B = M N0 episodes
    of the batch `ids` [M] with the allocation `alloc`, and the step's outcomes (`loss`,
    `rewards` [B], `prompt` [B])."""
    config = self.config
    num_prompts = config.batch_size
    prompt = sharding.split_rows(
        flat.rollout_segments(alloc.counts, num_prompts * config.baseline_n), self.mesh)
    # Slots past the counts (none while the counts fill the budget) are prompt M: padding.
    scenario_ids = jnp.concatenate([ids, ids[:1]])[prompt]
    observations, actions, rewards = self.episodes(params, scenario_ids, key)
    advantages = flat.flat_advantages(rewards, prompt, num_prompts=num_prompts,
                                      estimator=self.allocation.estimator_spec)
    log_probs = self.policy.log_prob_episodes(params, observations, actions)
    # The loss is linear in the episodes' log-probabilities: its gradient is
    # sum_b coef_b grad log pi(tau_b).
    loss, coefficients = jax.value_and_grad(flat.flat_policy_loss)(
        log_probs, advantages, prompt, alloc.weights, baseline_n=config.baseline_n)
    grads = jax.grad(lambda p: jnp.sum(jax.lax.stop_gradient(coefficients)
                                       * self.policy.log_prob_episodes(p, observations,
                                                                       actions)))(params)
    return grads, {"loss": loss, "rewards": rewards, "prompt": prompt}

  def rl_step_fn(self, state: SimState, ids: jax.Array, step, new_epoch, scalars=None
                 ) -> tuple[SimState, dict]:
    """RL step (unjitted) on the scenarios `ids`, its episodes drawn from
    fold_in(state.rng, step); `new_epoch` whether the batch opens an epoch > 0. `scalars`
    ({field: value} of `registry.SCALARS`; a batch's run's own) replace the config's."""
    config = self.config
    historical, alloc, log_p = historical_allocation(self.allocation.replace(**scalars or {}),
                                                     state.historical, ids, new_epoch, True)
    has_estimate = historical.seen[ids]
    grads, outcome = self.policy_gradient(state.params, ids, alloc,
                                          jax.random.fold_in(state.rng, step))
    rewards, prompt = outcome["rewards"], outcome["prompt"]
    historical = success.historical_stage_flat(historical, ids, rewards, prompt)
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    group_successes = jax.ops.segment_sum(rewards, prompt, config.batch_size)
    metrics = allocation.rollout_metrics(alloc, group_successes, log_p, estimated=True) | {
        "loss": outcome["loss"],
        "reward/mean": jnp.mean(rewards),  # over episodes: SERA weights hard scenarios up
        **episodes.success_means(alloc.counts, group_successes, log_p, prompt="scenario"),
        # The share of the step's episodes spent on the scenarios estimated hard.
        "budget/hard_fraction": jnp.sum(jnp.where(log_p < jnp.log(HARD_P), alloc.counts, 0))
                                / (config.batch_size * config.baseline_n),
        "estimated_fraction": jnp.mean(has_estimate),
        "policy/log_std": jnp.mean(params["log_std"]),
    }
    return SimState(params, opt_state, state.rng, historical), metrics

  def eval_successes_fn(self, params, rng: jax.Array, scenario_ids: jax.Array, start,
                        key_tag) -> jax.Array:
    """Successes among config.eval_samples episodes of each of the eval_batch_size scenarios
    of `scenario_ids` from `start`, int32 [eval_batch_size], drawn from `rng` folded with
    `key_tag` (one per evaluation set) and `start`; the episodes are split over the mesh."""
    batch, samples = self.config.eval_batch_size, self.config.eval_samples
    ids = jax.lax.dynamic_slice_in_dim(scenario_ids, start, batch)
    flat_ids = sharding.split_rows(jnp.repeat(ids, samples), self.mesh)
    key = jax.random.fold_in(jax.random.fold_in(rng, key_tag), start)
    _, _, rewards = self.episodes(params, flat_ids, key)
    return jnp.sum(rewards.reshape(batch, samples), axis=1).astype(jnp.int32)
