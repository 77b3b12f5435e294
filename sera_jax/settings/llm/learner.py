"""SERA and uniform MaxRL inside Tunix's GRPO learner (DESIGN §4).

Importing this module registers with Tunix's function registry:

* advantage estimators "maxrl" and "maxrl_plain": `sera_jax.advantages` on
  Tunix's fixed groups of num_generations, so the stock `GRPOLearner` trains
  uniform MaxRL with `GRPOConfig(advantage_estimator="maxrl")`;
* the policy loss "sera_budget_norm": Tunix's GRPO loss with every rollout's
  token sum divided by the rows of its micro-batch (empty completions
  included), which on-policy (one iteration, beta = 0) and with the budget in
  equal micro-batches is -(1 / B) sum_i A_i log pi(y_i).

`SeraLearner` is Tunix's GRPO learner with the allocation of DESIGN §1: for
each batch of M prompts it reads log p from the historical estimator keyed by
each example's dataset index (frozen within an epoch; uniform counts until
every prompt of the batch has an estimate), allocates counts with sum
B = M * N0 (N0 = num_generations), repeats the prompts by their counts into
exactly B generation requests, scores them, and trains on flat advantages with
the prompt weights folded in, so the loss is
-(1 / (M N0)) sum_i w_q(i) A_i log pi(y_i). The estimator's state is saved
inside every actor checkpoint (its custom metadata) and restored with it.
"""

import dataclasses
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tunix.rl import algo_core, function_registry
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl import utils as rl_utils
from tunix.rl.grpo import grpo_learner

from sera_jax.method import allocation, estimators, flat, success, validation

BUDGET_NORM_LOSS = "sera_budget_norm"
TOKEN_SUM_NORM = "sequence-mean-token-sum-norm"
ESTIMATOR_KEY = "sera_estimator"  # in the custom metadata of every actor checkpoint


def _fixed_group_estimator(estimator: str):
  """A Tunix advantage estimator: `estimator`'s advantages of contiguous groups."""

  def estimate(rewards, num_generations: int, **unused) -> jax.Array:
    groups = jnp.asarray(rewards, jnp.float32).reshape(-1, num_generations)
    return estimators.advantages(groups, jnp.ones(groups.shape, bool),
                                 estimator=estimator).reshape(-1)

  estimate.__name__ = f"{estimator}_advantages"
  return estimate


for _name in ("maxrl", "maxrl_plain"):
  function_registry.register_advantage_estimator(_name)(_fixed_group_estimator(_name))


@function_registry.register_policy_loss_fn(BUDGET_NORM_LOSS)
def budget_norm_loss(model, train_example, algo_config, pad_id, eos_id, **kwargs):
  """Tunix's GRPO loss summed over tokens and rollouts, divided by the micro-batch's rows.

  With loss_agg_mode "sequence-mean-token-sum-norm" Tunix divides by the rows that
  hold at least one completion token; rescaling by those over all rows divides by
  every row, so an empty completion does not change the normalisation.
  """
  if algo_config.loss_agg_mode != TOKEN_SUM_NORM:
    raise ValueError(f"the {BUDGET_NORM_LOSS!r} policy loss needs loss_agg_mode="
                     f"{TOKEN_SUM_NORM!r}; got {algo_config.loss_agg_mode!r}.")
  loss, aux = algo_core.grpo_loss_fn(model, train_example, algo_config, pad_id, eos_id,
                                     **kwargs)
  mask = train_example.completion_mask
  non_empty = jnp.maximum(jnp.sum(jnp.sum(mask, axis=-1) > 0), 1)
  return loss * non_empty / mask.shape[0], aux


@dataclasses.dataclass(kw_only=True)
class SeraConfig(grpo_learner.GRPOConfig):
  """`GRPOConfig` with SERA's allocation (DESIGN §1); num_generations is N0.

  Attributes:
    allocation: "sera", "equalized" or "uniform" (`sera_jax.allocate`'s modes).
    estimator: the advantage estimator (`sera_jax.ESTIMATORS`).
    n_min, n_max, threshold, normalize_by_rollout_count, normalize_by_rho: as
      in `sera_jax.allocate`.
    dataset_size: P, the training prompts; examples carry their index in [0, P)
      under `index_key`, and an epoch is P / M batches.
    index_key: the batch key of the dataset index.
    discount, alpha0, beta0: the historical estimator (DESIGN §1.5).
    rollout_seed: when set, each generation call samples with its own key,
      folded from rollout_seed, the batch count and the chunk; Tunix's sampler
      otherwise draws every call with PRNGKey(0), so a prompt that returns to
      the same rows of a later batch (or chunk) meets the same sampling noise.
    generation_batch_size: rollouts generated at once (a multiple of N0 that
      divides B; all B when None): bounds the sampler's KV cache. Needs
      rollout_seed, as chunks drawn with one key would repeat each other.
  """
  allocation: str = "sera"
  estimator: str = "maxrl"
  n_min: int = 2
  n_max: int = 64
  threshold: float = 0.05
  normalize_by_rollout_count: bool = True
  normalize_by_rho: bool = False
  dataset_size: int = 0
  index_key: str = "idx"
  discount: float = 0.75
  alpha0: float = 0.5
  beta0: float = 0.5
  rollout_seed: int | None = None
  generation_batch_size: int | None = None
  policy_loss_fn: str = BUDGET_NORM_LOSS
  loss_agg_mode: str = TOKEN_SUM_NORM
  beta: float = 0.0

  def __post_init__(self):
    super().__post_init__()
    validation.choice("allocation", self.allocation, allocation.MODES)
    validation.choice("estimator", self.estimator, estimators.ESTIMATORS)
    allocation._check_bounds(self.num_generations, self.n_min, self.n_max)
    validation.in_unit_interval("threshold", self.threshold)
    validation.integer("dataset_size", self.dataset_size, minimum=1)
    validation.in_unit_interval("discount", self.discount)
    if self.generation_batch_size is not None:
      validation.integer("generation_batch_size", self.generation_batch_size, minimum=1)
      if self.rollout_seed is None:
        raise ValueError("generation_batch_size needs a rollout_seed: chunks sampled with "
                         "Tunix's default key would repeat one another's noise.")
      if self.generation_batch_size % self.num_generations:
        raise ValueError(f"generation_batch_size ({self.generation_batch_size}) must be a "
                         f"multiple of num_generations ({self.num_generations}).")
    if self.num_iterations != 1:
      raise ValueError(f"SeraLearner trains on-policy: num_iterations must be 1; got "
                       f"{self.num_iterations}.")

  @property
  def baseline_n(self) -> int:
    return self.num_generations


class SeraLearner(grpo_learner.GRPOLearner[SeraConfig]):
  """Tunix's GRPO learner with SERA's variable rollouts per prompt (see the module doc).

  One global step is one batch of M prompts trained as one optimizer step; the
  budget may be split into equal train micro-batches (gradient accumulation).

  Attributes:
    historical: the estimator state over the dataset's prompts.
    batches_seen: training batches allocated so far (epochs are dataset_size / M).
    last_counts: the counts of the latest training batch (int [M]).
    last_log_p: the estimated log p its allocation used ([M]).
  """

  def __init__(self, rl_cluster: rl_cluster_lib.RLCluster, algo_config: SeraConfig,
               reward_fns, **kwargs):
    super().__init__(rl_cluster, algo_config, reward_fns, **kwargs)
    # Training data is prepared in an executor thread while evaluation data is
    # prepared on the main one: each thread keeps its own last rewards.
    self._rewards = threading.local()
    self.historical = success.historical_init(algo_config.dataset_size)
    self.batches_seen = 0
    self.last_counts = self.last_log_p = None
    self._evaluations = 0
    self._generation_key, self._chunks = None, 0
    if algo_config.rollout_seed is not None:
      self._seed_each_generation()
    self._allocate_step = jax.jit(self._allocate_fn)
    self._finish_step = jax.jit(self._finish_fn)
    self._save_with_checkpoints()
    self._restore_estimator()

  # ---- the seams of Tunix's learner ---------------------------------------------------------

  def _num_generations(self) -> int:
    return 1  # prompts are repeated by their counts in `_process_accumulated_batches`

  def _compute_rewards(self, *args, **kwargs):
    rewards = super()._compute_rewards(*args, **kwargs)
    self._rewards.value = np.asarray(rewards, np.float32)
    return rewards

  def _compute_trajectory_ids(self, example, steps: int) -> list[str]:
    return [f"{steps}_{row}" for row in range(len(example["prompts"]))]

  def _process_accumulated_batches(self, micro_batches, micro_batch_sizes, mode):
    if not micro_batches:
      return []
    config = self.algo_config
    batch = {key: value for key, value in rl_utils.merge_micro_batches(micro_batches).items()
             if key != "trajectory_ids"}
    ids = np.asarray(batch[config.index_key])
    budget = len(ids) * config.baseline_n
    slices = len(micro_batch_sizes)
    if budget % slices:
      raise ValueError(f"the rollout budget B = {budget} must split into the {slices} train "
                       f"micro-batches of a step.")
    chunk = config.generation_batch_size or budget
    if budget % chunk:
      raise ValueError(f"generation_batch_size ({chunk}) must divide the rollout budget "
                       f"B = {budget}.")
    training = mode == rl_cluster_lib.Mode.TRAIN
    steps_per_epoch = max(config.dataset_size // len(ids), 1)
    new_epoch = training and self.batches_seen > 0 and self.batches_seen % steps_per_epoch == 0
    historical, alloc, log_p = self._allocate_step(self.historical, ids, new_epoch, training)
    counts = np.asarray(alloc.counts)
    requests = jax.tree.map(lambda value: np.repeat(np.asarray(value), counts, axis=0), batch)
    if config.rollout_seed is not None:
      self._generation_key, self._chunks = self._batch_key(mode), 0
    # Tunix generates rollout_micro_batch_size * N0 sequences at a time.
    prompts_per_step, self._rollout_micro_batch_size = (self._rollout_micro_batch_size,
                                                        chunk // config.num_generations)
    try:
      example = self._generate_and_compute_advantage(requests, mode)
    finally:
      self._rollout_micro_batch_size = prompts_per_step
    advantages, historical, metrics = self._finish_step(historical, ids, self._rewards.value,
                                                        alloc, log_p)
    example = example.replace(advantages=advantages)
    if training:
      self.historical, self.batches_seen = historical, self.batches_seen + 1
      self.last_counts, self.last_log_p = counts, np.asarray(log_p)
      self.rl_cluster.buffer_metrics(
          {name: (float(value), np.mean) for name, value in jax.device_get(metrics).items()},
          mode=mode)
    size = budget // slices
    return [rl_utils.get_batch_slice(example, slice(i * size, (i + 1) * size))
            for i in range(slices)]

  def _batch_key(self, mode) -> jax.Array:
    """The generation key of the next batch in `mode`: training batches by their count,
    evaluation batches by theirs (so a resumed run draws what an uninterrupted one does)."""
    training = mode == rl_cluster_lib.Mode.TRAIN
    if not training:
      self._evaluations += 1
    key = jax.random.fold_in(jax.random.PRNGKey(self.algo_config.rollout_seed), int(training))
    return jax.random.fold_in(key, self.batches_seen if training else self._evaluations)

  def _seed_each_generation(self) -> None:
    """Gives every generate call of the rollout (one per chunk of a batch) its own key.

    Tunix passes one RolloutConfig to every chunk and its sampler donates the
    seed's buffer, so each call gets a fresh key folded from the batch's.
    """
    rollout = self.rl_cluster.rollout
    generate = rollout.generate

    def generate_with_own_key(prompts, rollout_config, **kwargs):
      if self._generation_key is not None:
        # The first chunk draws with (a copy of: the sampler donates it) the batch's key
        # itself, so one call a batch samples exactly as before chunks had keys of their own.
        key = (jax.random.fold_in(self._generation_key, self._chunks) if self._chunks
               else jnp.copy(self._generation_key))
        self._chunks += 1
        rollout_config = dataclasses.replace(rollout_config, seed=key)
      return generate(prompts, rollout_config, **kwargs)

    rollout.generate = generate_with_own_key

  # ---- allocation and the historical estimator (jitted) -------------------------------------

  def _allocate_fn(self, historical, ids, new_epoch, training):
    """The batch's allocation from the frozen estimate; uniform until all are estimated
    (and for evaluation batches)."""
    config = self.algo_config
    historical = jax.tree.map(
        lambda started, kept: jnp.where(new_epoch, started, kept),
        success.historical_start_epoch(historical, discount=config.discount), historical)
    log_p, has_estimate = success.historical_estimate(historical, ids, alpha0=config.alpha0,
                                                      beta0=config.beta0)
    uniform = allocation.allocate_from_config(log_p, config, "uniform")
    chosen = allocation.allocate_from_config(log_p, config, config.allocation)
    use_chosen = training & jnp.all(has_estimate)
    alloc = jax.tree.map(lambda a, b: jnp.where(use_chosen, a, b), chosen, uniform)
    return historical, alloc, log_p

  def _finish_fn(self, historical, ids, rewards, alloc, log_p):
    """Weighted flat advantages, the staged outcomes and the step's allocation metrics."""
    config = self.algo_config
    num_prompts = ids.shape[0]
    segments = flat.rollout_segments(alloc.counts, rewards.shape[0])
    advantages = flat.flat_advantages(rewards, segments, num_prompts=num_prompts,
                                      estimator=config.estimator)
    # w_q(i) A_i: the loss divides by B = M N0 (the budget-normalised policy loss).
    weighted = (alloc.weights[segments] * advantages).astype(jnp.float32)
    staged = success.historical_stage_flat(historical, ids, rewards, segments)
    successes = jax.ops.segment_sum(rewards, segments, num_prompts)
    metrics = allocation.rollout_metrics(alloc, successes, log_p, estimated=True)
    return weighted, staged, metrics

  # ---- the estimator's state inside the actor's checkpoints ---------------------------------

  def _save_with_checkpoints(self) -> None:
    """Puts the estimator's state in the custom metadata of every actor checkpoint.

    Orbax writes a step's metadata into the step's temporary directory and
    finalizes both with one rename, so the estimator is never behind (or ahead
    of) the actor it was saved with: a run killed at any moment resumes from a
    checkpoint that holds both. Tunix's own last save (on close) passes no
    metadata; it gets the estimator too.
    """
    manager = self.rl_cluster.actor_trainer.checkpoint_manager
    save = manager.save

    def save_actor_and_estimator(step, *args, force=False, custom_metadata=None, **kwargs):
      orbax = manager._checkpoint_manager  # None when the run has no checkpoint directory
      if orbax is not None and (force or orbax.should_save(step)):
        custom_metadata = {**(custom_metadata or {}), ESTIMATOR_KEY: self._estimator_state()}
      return save(step, *args, force=force, custom_metadata=custom_metadata, **kwargs)

    manager.save = save_actor_and_estimator

  def _estimator_state(self) -> dict[str, Any]:
    """The historical estimator and the batch counters, as JSON (floats round-trip exactly)."""
    return {"batches_seen": self.batches_seen, "evaluations": self._evaluations,
            **{name: np.asarray(value).tolist()
               for name, value in self.historical._asdict().items()}}

  def _restore_estimator(self) -> None:
    """Loads the estimator state saved with the actor checkpoint the run resumed from."""
    trainer = self.rl_cluster.actor_trainer
    step = trainer.train_steps
    if not step:
      return
    saved = dict(trainer._restored_custom_metadata.get(ESTIMATOR_KEY) or {})
    root = self.rl_cluster.cluster_config.training_config.checkpoint_root_directory
    if not saved:
      raise ValueError(f"the actor checkpoint of step {step} in {root} holds no SERA estimator "
                       f"state (another learner or an older sera_jax wrote it): train SERA in a "
                       f"new checkpoint directory.")
    size = self.algo_config.dataset_size
    if len(saved["seen"]) != size:
      raise ValueError(f"the actor checkpoint of step {step} in {root} holds the estimator of "
                       f"{len(saved['seen'])} prompts, but dataset_size is {size}: resume with "
                       f"the dataset it was trained on, or train in a new checkpoint directory.")
    self.batches_seen = int(saved.pop("batches_seen"))
    self._evaluations = int(saved.pop("evaluations"))
    empty = success.historical_init(size)
    self.historical = success.HistoricalState(**{
        name: jnp.asarray(saved[name], getattr(empty, name).dtype)
        for name in success.HistoricalState._fields})


def epoch_batches(columns: dict[str, np.ndarray], batch_size: int,
                  seed: int) -> Iterator[dict[str, np.ndarray]]:
  """Batches of `batch_size` problems, epoch after epoch without end.

  Each epoch is the permutation of np.random.default_rng([seed, epoch]) cut into
  P // batch_size batches (the last partial one dropped), as `SeraLearner` counts epochs:
  a resumed run (Tunix skips the batches it already trained on) sees the same batches as
  an uninterrupted one.
  """
  size = len(columns["idx"])
  if not 1 <= batch_size <= size:
    raise ValueError(f"batch_size must lie in [1, {size}] (the training problems); "
                     f"got {batch_size}.")

  def epochs():
    for epoch in itertools.count():
      order = np.random.default_rng([seed, epoch]).permutation(size)
      for start in range(0, size - batch_size + 1, batch_size):
        rows = order[start:start + batch_size]
        yield {key: value[rows] for key, value in columns.items()}

  return epochs()

