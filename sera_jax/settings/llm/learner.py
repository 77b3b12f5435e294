"""SERA and uniform MaxRL inside Tunix's GRPO learner (docs/method.md#llm-post-training).

Importing this module registers with Tunix's function registry:

* advantage estimators "maxrl" and "maxrl_plain": `sera_jax.advantages` on
  Tunix's fixed groups of num_generations, so the stock `GRPOLearner` trains
  uniform MaxRL with `GRPOConfig(advantage_estimator="maxrl")`;
* the policy loss "sera_budget_norm": Tunix's GRPO loss with every rollout's
  token sum divided by the rows of its micro-batch (empty completions
  included), which on-policy (one iteration, beta = 0) and with the budget in
  equal micro-batches is -(1 / B) sum_i A_i log pi(y_i).

`SeraLearner` is Tunix's GRPO learner with the allocation of
docs/method.md#the-estimator-and-its-scale: for each batch of M prompts it reads log p from the
historical estimator keyed by each example's dataset index (frozen within an epoch; a prompt
without an estimate of its own gets the mean over the prompts seen), or from an oracle
(`SeraConfig.log_p_source`), allocates counts with sum B = M * N0 (N0 = num_generations),
uniform only while no prompt has been seen and for evaluation batches, repeats the prompts by
their counts into exactly B generation requests, scores them, and trains on flat advantages
with the prompt weights folded in, so the loss is -(1 / (M N0)) sum_i w_q(i) A_i log pi(y_i).
The estimator's state is saved inside every actor checkpoint (its custom metadata) and
restored with it.

The learner runs on any ("fsdp", "tp") meshes of one controller process (one
host, or a multi-host slice through Pathways), colocated or with the rollout on
devices of its own. It refuses what would break the allocation or its 1/B
normalisation: one process per host, a batch that Tunix would score or update
in parts, sequence packing, and train micro-batches the fsdp axis cannot split.
Beyond Tunix's public API it reaches Tunix only through `tunix_compat`.
"""

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.generate import utils as generate_utils
from tunix.rl import algo_core, common, function_registry
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl import utils as rl_utils
from tunix.rl.grpo import grpo_learner

from sera_jax.method import allocation, estimators, flat, registry, success, validation
from sera_jax.method.historical import historical_allocation
from sera_jax.settings.llm import tunix_compat

BUDGET_NORM_LOSS = "sera_budget_norm"
TOKEN_SUM_NORM = "sequence-mean-token-sum-norm"
# SeraConfig's advantage_estimator: SeraLearner computes the flat advantages of its variable
# groups itself, so no Tunix estimator runs (none is registered under this name).
DEFERRED_ADVANTAGES = "sera_deferred"
ESTIMATOR_KEY = "sera_estimator"  # in the custom metadata of every actor checkpoint
# What the learner offers an allocation (`registry.AllocationInputs`): log p alone. gvm would
# need each prompt's gradient norm (a backward pass a prompt), adaptive sampling the rewards of
# the rollouts before their counts are fixed (generation in rounds).
INPUTS = ("log_p",)


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
  """`GRPOConfig` with SERA's allocation; num_generations is N0.

  See docs/method.md#the-estimator-and-its-scale.

  Attributes:
    allocation: the allocation mode, one of `sera_jax.ALLOCATORS` that reads log p alone
      (`INPUTS`): "sera", "equalized", "uniform" or "knapsack".
    estimator: the advantage estimator, a registered name
      (`sera_jax.method.estimators.registered_estimators()`).
    estimator_kwargs: its keyword parameters (e.g. {"k": 4} for "pkpo").
    n_min, n_max, threshold, normalize_by_rollout_count, normalize_by_rho: as
      in `sera_jax.allocate`.
    dataset_size: P, the training prompts; examples carry their index in [0, P)
      under `index_key`, and an epoch is P / M batches.
    index_key: the batch key of the dataset index.
    discount, alpha0, beta0: the historical estimator (docs/method.md#estimating-p).
    rollout_seed: when set, each generation call samples with its own key,
      folded from rollout_seed, the batch count and the chunk; Tunix's sampler
      otherwise draws every call with PRNGKey(0), so a prompt that returns to
      the same rows of a later batch (or chunk) meets the same sampling noise.
    generation_batch_size: rollouts generated at once (a multiple of N0 that
      divides B; all B when None): bounds the sampler's KV cache. Needs
      rollout_seed, as chunks drawn with one key would repeat each other.
    log_p_source: where a training batch's log p comes from: "historical" (the
      discounted Beta estimator, docs/method.md#estimating-p) or an oracle, a function
      (model, batch) -> log p [M] of the actor and the batch's columns (e.g.
      `arithmetic.batch_log_p`, the exact teacher-forced log p), like the
      classification setting's oracle mode.
    exact_log_p: the task's exact log p, a function (model, batch) -> [M] whose
      gradient is the exact likelihood gradient; needed by align_every.
    align_every: every this many training batches (0: never), log the cosines
      of the step's realized gradient, of its expected gradient and of uniform
      MaxRL's expected gradient with the exact gradient (`SeraLearner.alignment`).
  """
  allocation: str = "sera"
  estimator: str = "maxrl"
  estimator_kwargs: Mapping[str, Any] | tuple[tuple[str, Any], ...] = ()
  n_min: int = 2
  n_max: int = 64
  threshold: float = 0.05
  normalize_by_rollout_count: bool = True
  normalize_by_rho: bool = False
  dataset_size: int = 0
  index_key: str = "idx"
  discount: float = success.DISCOUNT
  alpha0: float = success.ALPHA0
  beta0: float = success.BETA0
  rollout_seed: int | None = None
  generation_batch_size: int | None = None
  log_p_source: str | Callable[[nnx.Module, dict[str, np.ndarray]], jax.Array] = "historical"
  exact_log_p: Callable[[nnx.Module, dict[str, np.ndarray]], jax.Array] | None = None
  align_every: int = 0
  advantage_estimator: str = DEFERRED_ADVANTAGES
  policy_loss_fn: str = BUDGET_NORM_LOSS
  loss_agg_mode: str = TOKEN_SUM_NORM
  beta: float = 0.0

  def __post_init__(self):
    super().__post_init__()
    registry.check_mode(self.allocation, name="allocation")
    registry.require(self.allocation_config.mode, INPUTS, who="SeraLearner")
    validation.integer("dataset_size", self.dataset_size, minimum=1)
    if self.generation_batch_size is not None:
      validation.integer("generation_batch_size", self.generation_batch_size, minimum=1)
      if self.rollout_seed is None:
        raise ValueError("generation_batch_size needs a rollout_seed: chunks sampled with "
                         "Tunix's default key would repeat one another's noise.")
      if self.generation_batch_size % self.num_generations:
        raise ValueError(f"generation_batch_size ({self.generation_batch_size}) must be a "
                         f"multiple of num_generations ({self.num_generations}).")
    if self.advantage_estimator != DEFERRED_ADVANTAGES:
      raise ValueError(f"SeraLearner's advantages come from `estimator` (got "
                       f"advantage_estimator={self.advantage_estimator!r}); leave "
                       f"advantage_estimator at its default.")
    if not callable(self.log_p_source):
      validation.choice("log_p_source", self.log_p_source, ("historical",))
    validation.integer("align_every", self.align_every, minimum=0)
    if self.align_every and self.exact_log_p is None:
      raise ValueError("align_every needs exact_log_p, the task's exact log p (model, batch) -> "
                       "[M], to take the exact gradient.")
    if self.num_iterations != 1:
      raise ValueError(f"SeraLearner trains on-policy: num_iterations must be 1; got "
                       f"{self.num_iterations}.")

  @property
  def allocation_config(self) -> registry.AllocationConfig:
    """The allocation of these fields (N0 = num_generations), checked."""
    return registry.AllocationConfig(
        mode=self.allocation, baseline_n=self.num_generations, n_min=self.n_min,
        n_max=self.n_max, threshold=self.threshold,
        normalize_by_rollout_count=self.normalize_by_rollout_count,
        normalize_by_rho=self.normalize_by_rho, estimator=self.estimator,
        estimator_kwargs=self.estimator_kwargs,
        discount=self.discount, alpha0=self.alpha0, beta0=self.beta0)

  @property
  def baseline_n(self) -> int:
    """N0, the mean rollouts a prompt (num_generations)."""
    return self.num_generations


class Rollouts(NamedTuple):
  """A batch's B rollouts, generated and scored (`SeraLearner.generate_and_score`).

  Attributes:
    example: their TrainExample as Tunix's GRPO learner makes it, but for advantages (None:
      the caller's); its completion mask is Tunix's, the completion ids other than the pad id.
    rewards: float32 [B], each rollout's reward (0 or 1).
    lengths: [B], the tokens of each rollout's score: those sampled and, when it stopped, the
      stop token it sampled.
    completions: the B completions' text, as the reward functions read it.
  """
  example: common.TrainExample
  rewards: np.ndarray
  lengths: np.ndarray
  completions: list[str]


class SeraLearner(tunix_compat.WholeBatchLearner[SeraConfig]):
  """Tunix's GRPO learner with SERA's variable rollouts per prompt (see the module doc).

  One global step is one batch of M prompts trained as one optimizer step; the
  budget may be split into equal train micro-batches (gradient accumulation).
  Tunix's metric_fns receive the advantages the loss trains, w_q(i) A_i. Beside
  Tunix's rewards/score/mean, a mean over rollouts that SERA's uneven counts tilt
  toward the prompts given more, rewards/prompt_mean logs the mean over the
  prompts with rollouts of each one's success rate, which compares across
  allocations.

  Attributes:
    historical: the estimator state over the dataset's prompts.
    batches_seen: training batches allocated so far (epochs are dataset_size / M).
    last_counts: the counts of the latest training batch (int [M]).
    last_log_p: the log p its allocation used ([M]).
    last_rewards: its rollouts' rewards (float32 [B]).
    last_alignment: the latest step's alignment metrics (see `alignment`), or None.
  """

  def __init__(self, rl_cluster: rl_cluster_lib.RLCluster, algo_config: SeraConfig,
               reward_fns, **kwargs):
    if jax.process_count() > 1:
      raise RuntimeError(
          f"SeraLearner needs one controller process that sees every device: run a multi-host "
          f"slice through Pathways; this is process {jax.process_index()} of "
          f"{jax.process_count()}, and Tunix's RL path does not support one process per host.")
    packing = rl_cluster.cluster_config.training_config.max_seq_token_per_tpu
    if packing is not None:
      raise ValueError(f"SeraLearner divides each train micro-batch's loss by its rows (1/B "
                       f"over a step), which sequence packing changes: leave "
                       f"max_seq_token_per_tpu None (got {packing}).")
    super().__init__(rl_cluster, algo_config, reward_fns, **kwargs)
    self.historical = success.historical_init(algo_config.dataset_size)
    self.batches_seen = 0
    self.last_counts = self.last_log_p = self.last_rewards = self.last_alignment = None
    self._evaluations = 0
    self.forbidden = self._check_sampling()
    tunix_compat.sample_policy(self.rl_cluster.rollout, self.forbidden)
    tunix_compat.score_policy(self.rl_cluster.actor_trainer, self.forbidden)
    if algo_config.rollout_seed is not None:
      tunix_compat.seed_each_generation(self.rl_cluster.rollout)
    self._allocate_step = jax.jit(self._allocate_fn)
    self._finish_step = jax.jit(self._finish_fn, static_argnames="exact")
    self._loss_gradient = None  # jitted when first needed (alignment)
    self._stack_metrics = jax.jit(lambda metrics: jnp.stack(
        [jnp.asarray(metrics[name], jnp.float32) for name in sorted(metrics)]))
    # Every actor checkpoint holds the estimator it was trained with: a run killed at any
    # moment resumes from a checkpoint that holds both.
    tunix_compat.save_metadata_with_checkpoints(
        self.rl_cluster.actor_trainer.checkpoint_manager, ESTIMATOR_KEY, self._estimator_state)
    self._restore_estimator()

  # ---- one batch: allocate, generate, score, train ------------------------------------------

  def process_batch(self, batch: dict[str, Any], train_micro_batches: int,
                    mode: rl_cluster_lib.Mode) -> list[common.TrainExample]:
    """The batch's allocation, rollouts and advantages, in `train_micro_batches` equal slices
    of its B rollouts; for a training batch, the estimator's update and the step's metrics."""
    config = self.algo_config
    ids = np.asarray(batch[config.index_key])
    if not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or \
        ids.max() >= config.dataset_size:
      raise ValueError(f"the batch's {config.index_key!r} must hold integer dataset indices in "
                       f"[0, dataset_size = {config.dataset_size}); got {ids.tolist()}.")
    budget = len(ids) * config.baseline_n
    if budget % train_micro_batches:
      raise ValueError(f"the rollout budget B = {budget} must split into the "
                       f"{train_micro_batches} train micro-batches of a step.")
    chunk = config.generation_batch_size or budget
    if budget % chunk:
      raise ValueError(f"generation_batch_size ({chunk}) must divide the rollout budget "
                       f"B = {budget}.")
    training = mode == rl_cluster_lib.Mode.TRAIN
    steps_per_epoch = max(config.dataset_size // len(ids), 1)
    new_epoch = training and self.batches_seen > 0 and self.batches_seen % steps_per_epoch == 0
    oracle_log_p = None
    if training and callable(config.log_p_source):
      oracle_log_p = config.log_p_source(self.policy(self.rl_cluster.actor_trainer.model), batch)
    historical, alloc, log_p = self._allocate_step(self.historical, ids, new_epoch, training,
                                                   oracle_log_p)
    counts = np.asarray(alloc.counts)
    requests = jax.tree.map(lambda value: np.repeat(np.asarray(value), counts, axis=0), batch)
    rollouts = self.generate_and_score(requests, mode, chunk)
    advantages, mask, historical, metrics = self._finish_step(
        historical, ids, rollouts.rewards, rollouts.lengths, alloc, log_p,
        rollouts.example.completion_mask, exact=oracle_log_p is not None)
    example = rollouts.example.replace(advantages=advantages, completion_mask=mask)
    if self.metric_fns:
      self._log_metric_fns(requests, rollouts, np.asarray(advantages), mode)
    size = budget // train_micro_batches
    slices = [example] if train_micro_batches == 1 else [
        rl_utils.get_batch_slice(example, slice(i * size, (i + 1) * size))
        for i in range(train_micro_batches)]
    if training:
      self.historical, self.batches_seen = historical, self.batches_seen + 1
      self.last_counts, self.last_log_p = counts, np.asarray(log_p)
      self.last_rewards = rollouts.rewards
      if config.align_every and (self.batches_seen - 1) % config.align_every == 0:
        self.last_alignment = self.alignment(batch, alloc, slices)
        metrics = {**metrics, **self.last_alignment}
      # One transfer for all of them (a device_get of the dict copies each scalar alone).
      values = np.asarray(self._stack_metrics(metrics)).tolist()
      self.rl_cluster.buffer_metrics(
          {name: (value, np.mean) for name, value in zip(sorted(metrics), values, strict=True)},
          mode=mode)
    return slices

  def check_step(self, batch_size: int, mini_batch_size: int, scored_together: int,
                 train_micro_batches: int) -> None:
    """Refuses micro-batch settings under which SERA would not allocate (and train) a batch
    whole, with Tunix's sizes as `RLLearner.train` resolved them.

    Tunix scores `scored_together` prompts (the least common multiple of the
    rollout and log-prob micro-batch sizes) in one `process_batch` call, and
    updates the actor after every mini-batch; both must be the batch. Each train
    micro-batch's rows must split over the actor's data axes, which Tunix would
    otherwise replicate on every device.
    """
    training = self.rl_cluster.cluster_config.training_config
    if mini_batch_size != batch_size:
      raise ValueError(f"SERA allocates and trains all M = {batch_size} prompts of a batch as "
                       f"one optimizer step; mini_batch_size = {mini_batch_size} would make "
                       f"{batch_size // mini_batch_size} steps of it: leave mini_batch_size None "
                       f"or set it to the batch size.")
    if scored_together != batch_size:
      rollout, logps = self.micro_batch_sizes
      raise ValueError(f"SERA allocates over all M = {batch_size} prompts of a batch, but Tunix "
                       f"would hand the learner {scored_together} at a time (the least common "
                       f"multiple of rollout_micro_batch_size = {rollout} and "
                       f"compute_logps_micro_batch_size = {logps}, which default to "
                       f"train_micro_batch_size): set rollout_micro_batch_size to the batch "
                       f"size (the sampler's chunk is SeraConfig.generation_batch_size).")
    budget = batch_size * self.algo_config.baseline_n
    mesh = self.rl_cluster.r2m[rl_cluster_lib.Role.ACTOR]
    shards = int(np.prod([mesh.shape[axis] for axis in training.data_sharding_axis]))
    if budget % train_micro_batches == 0 and (budget // train_micro_batches) % shards:
      raise ValueError(f"a train micro-batch holds B / {train_micro_batches} = "
                       f"{budget // train_micro_batches} rollouts, which the actor mesh's "
                       f"{tuple(training.data_sharding_axis)} axes ({shards} devices) do not "
                       f"divide, so Tunix would replicate it on every device: choose "
                       f"batch_size, num_generations and train_micro_batch_size so they do.")
    self._check_memory(budget // train_micro_batches, shards)

  def _check_memory(self, rows: int, shards: int) -> None:
    """Refuses a train micro-batch of `rows` rollouts that cannot fit the actor's devices, when
    they report their memory (`device_memory_limit`; a CPU does not): before the first
    generation, not after it.

    A lower bound, not an estimate: each device holds its shards of the actor's weights, its
    optimizer state (Tunix's gradient accumulation included) and a gradient of the weights,
    and the loss holds the float32 logits of its rows (prompt and completion, over the
    vocabulary) and their gradient; the step's other temporaries come on top
    (benchmarks/llm_memory.py measures a step, docs/scaling_llm.md).
    """
    mesh = self.rl_cluster.r2m[rl_cluster_lib.Role.ACTOR]
    limit = device_memory_limit(mesh.devices.flat)
    trainer = self.rl_cluster.actor_trainer
    vocab = getattr(getattr(trainer.model, "config", None), "vocab_size", None)
    if limit is None or vocab is None:
      return
    weights = _device_bytes(nnx.state(trainer.model, nnx.Param))
    state = _device_bytes(nnx.state(trainer.optimizer, nnx.optimizer.OptState))
    rollout = self.rl_cluster.get_rollout_config(rl_cluster_lib.Mode.TRAIN)
    length = rollout.max_prompt_length + rollout.max_tokens_to_generate
    logits = 2 * -(-rows // shards) * length * vocab * 4
    resident = 2 * weights + state
    if resident + logits > limit:
      gib = 2.0**30
      raise ValueError(f"a train micro-batch of {rows} rollouts of {length} tokens needs at "
                       f"least {(resident + logits) / gib:.1f} GiB on each actor device "
                       f"({resident / gib:.1f} for the weights, their gradient and the "
                       f"optimizer state, {logits / gib:.1f} for the logits over the "
                       f"{vocab}-token vocabulary and their gradient), more than the "
                       f"{limit / gib:.1f} GiB a device has: lower train_micro_batch_size "
                       f"(benchmarks/llm_memory.py measures a step; see docs/scaling_llm.md).")

  def _check_sampling(self) -> tuple[int, ...]:
    """The tokens the policy may not emit; raises unless the training rollouts sample the law
    the loss scores (docs/llm.md, "The sampled policy").

    The loss scores log softmax(logits / T) at the rollouts' temperature T (Tunix's
    GRPOLearner sets the loss's from the training rollout config), so the rollouts must
    sample that softmax whole: top_p 1 (None is greedy), no top_k, T > 0. PAD may not be
    emitted unless it stops a rollout: Tunix's loss skips a PAD inside a completion (its
    positions and attention come from the pad mask) where the sampler does not, so the
    sampler never samples it (`tunix_compat.sample_policy`) and the loss and the exact log p
    score the same masked softmax (`tunix_compat.PolicyLogits`).
    """
    config = self.rl_cluster.get_rollout_config(rl_cluster_lib.Mode.TRAIN)
    top_k = config.top_k if config.top_k is not None and config.top_k > 0 else None
    if (config.top_p is None or config.top_p < 1.0 or top_k is not None
        or not config.temperature > 0 or self.algo_config.temperature != config.temperature):
      raise ValueError(f"SeraLearner scores the full softmax at the rollouts' temperature "
                       f"(the loss's, {self.algo_config.temperature}), so its rollouts must "
                       f"sample it: top_p=1.0, top_k=None, temperature > 0; got "
                       f"top_p={config.top_p}, top_k={config.top_k}, "
                       f"temperature={config.temperature}.")
    rollout = self.rl_cluster.rollout
    stops = config.eos_tokens or [rollout.eos_id()]
    return () if rollout.pad_id() in stops else (rollout.pad_id(),)

  def policy(self, model: nnx.Module) -> tunix_compat.PolicyLogits:
    """`model` as the law the rollouts sample: its logits, the tokens it may not emit masked,
    over the training temperature; what `exact_log_p` and `log_p_source` are given."""
    return tunix_compat.PolicyLogits(model, self.forbidden, self.algo_config.temperature)

  def generate_and_score(self, requests: dict[str, np.ndarray], mode: rl_cluster_lib.Mode,
                         chunk: int) -> Rollouts:
    """Generates a rollout of each request, `chunk` at a time, and scores it.

    As Tunix's GRPO learner does (its `_generate_and_compute_advantage`, which this learner
    does not call), with the model's rematerialisation off (`tunix_compat.without_remat`),
    each chunk sampled with its own key when rollout_seed is set (`_batch_key`), and the
    score of what was sampled: Tunix's sampler returns a completion up to, not including,
    the first of its stop tokens (eos_tokens, default the tokenizer's EOS), and its learner
    masks completion ids equal to the pad id, so the stop token that ended a rollout would
    never be trained (nor survive a stop token that is the pad id). A rollout shorter than
    max_tokens_to_generate stopped at the token `tunix_compat.recorded_stops` reads, which
    goes back after its tokens; a rollout of max_tokens_to_generate was cut off and has none.
    The returned lengths count both, and `process_batch` masks each row by its length, so
    log pi(y) is the score of the whole sampled sequence.
    """
    cluster = self.rl_cluster
    rollout_config = cluster.get_rollout_config(mode)
    prompts = list(requests["prompts"])
    key = self._batch_key(mode) if self.algo_config.rollout_seed is not None else None
    with (tunix_compat.without_remat(cluster.rollout.model()), tunix_compat.chunk_keys(key),
          tunix_compat.recorded_stops() as stops):
      output = cluster.generate(prompts=prompts, mode=mode, micro_batch_size=chunk)
      limit = rollout_config.max_tokens_to_generate
      stopped_by = stops(output.tokens, limit)
    pad, eos = cluster.rollout.pad_id(), cluster.rollout.eos_id()
    tokens = [row if stop < 0 else np.append(row, np.asarray(stop, row.dtype))
              for row, stop in zip(output.tokens, stopped_by, strict=True)]
    completion_ids = np.array([generate_utils.pad_to_length(row, target_length=limit,
                                                            pad_value=pad, left=False)
                               for row in tokens])
    prompt_ids = jnp.array(output.left_padded_prompt_tokens)
    stock_mask = np.not_equal(completion_ids, pad)
    completion_ids = jnp.array(completion_ids)
    reference = None
    if self.algo_config.beta != 0.0:
      reference = cluster.get_ref_per_token_logps(
          prompt_tokens=prompt_ids, completion_tokens=completion_ids, pad_id=pad, eos_id=eos,
          micro_batch_size=self.micro_batch_sizes[1] * self.algo_config.num_generations)
    rewards = np.asarray(self.compute_rewards(
        prompts, output.text, mode, **{k: v for k, v in requests.items() if k != "prompts"}))
    # Checked here, where they are concrete: inside the jitted steps a reward of 2
    # (Tunix sums a list of reward functions) or 0.5 would be used as is.
    bad = ~np.isin(rewards, (0.0, 1.0))
    if bad.any():
      raise ValueError(f"SERA needs binary rewards (0 or 1 per rollout; a list of reward "
                       f"functions is summed); got {rewards[bad][0]!r}.")
    stock_lengths = stock_mask.sum(axis=-1)
    cluster.buffer_metrics({
        "rewards/score/mean": (np.mean(rewards), np.mean),
        "rewards/score/max": (np.max(rewards), np.max),
        "rewards/score/min": (np.min(rewards), np.min),
        "completions/mean_length": (np.mean(stock_lengths), np.mean),
        "completions/max_length": (np.max(stock_lengths), np.max),
        "completions/min_length": (np.min(stock_lengths), np.min),
    }, mode=mode)
    example = common.TrainExample(
        prompt_ids=prompt_ids, prompt_mask=prompt_ids != pad, completion_ids=completion_ids,
        completion_mask=jnp.array(stock_mask), advantages=None,
        ref_per_token_logps=reference, old_per_token_logps=None)
    return Rollouts(example, rewards.astype(np.float32), np.array([len(row) for row in tokens]),
                    output.text)

  def _log_metric_fns(self, requests: dict[str, Any], rollouts: Rollouts,
                      advantages: np.ndarray, mode) -> None:
    """Buffers Tunix's metric_fns of the batch's rollouts with the advantages the loss trains,
    called as Tunix's learner calls them."""
    columns = {key: value for key, value in requests.items() if key != "prompts"}
    for metric_fn in self.metric_fns:
      self.rl_cluster.buffer_metrics(
          metric_fn(prompts=list(requests["prompts"]), completions=rollouts.completions,
                    advantages=advantages, rewards=rollouts.rewards, **columns), mode=mode)

  def _batch_key(self, mode) -> jax.Array:
    """The generation key of the next batch in `mode`: training batches by their count,
    evaluation batches by theirs (so a resumed run draws what an uninterrupted one does)."""
    training = mode == rl_cluster_lib.Mode.TRAIN
    if not training:
      self._evaluations += 1
    key = jax.random.fold_in(jax.random.PRNGKey(self.algo_config.rollout_seed), int(training))
    return jax.random.fold_in(key, self.batches_seen if training else self._evaluations)

  # ---- allocation and the historical estimator (jitted) -------------------------------------

  def _allocate_fn(self, historical, ids, new_epoch, training, oracle_log_p):
    """(historical, alloc, log_p) of a batch: `historical_allocation` on the frozen estimate.

    On the oracle's log p instead when the config has one (`log_p_source`).
    """
    inputs = registry.AllocationInputs(
        log_p=None if oracle_log_p is None else jnp.asarray(oracle_log_p, jnp.float32))
    return historical_allocation(self.algo_config.allocation_config, historical, ids,
                                 new_epoch, training, inputs)

  def _finish_fn(self, historical, ids, rewards, lengths, alloc, log_p, stock_mask, *, exact):
    """Weighted flat advantages, the completion mask by length, the staged outcomes and the
    step's allocation metrics.

    The mask holds each row's first `lengths` tokens, the score of what was sampled
    (its tokens and, when it stopped, its stop token; see `generate_and_score`), in place
    of Tunix's mask of the tokens that differ from the pad id.
    """
    config = self.algo_config
    num_prompts = ids.shape[0]
    segments = flat.rollout_segments(alloc.counts, rewards.shape[0])
    advantages = flat.flat_advantages(rewards, segments, num_prompts=num_prompts,
                                      estimator=config.allocation_config.estimator_spec)
    # w_q(i) A_i: the loss divides by B = M N0 (the budget-normalised policy loss).
    weighted = (alloc.weights[segments] * advantages).astype(jnp.float32)
    mask = jnp.arange(stock_mask.shape[1])[None, :] < lengths[:, None]
    staged = success.historical_stage_flat(historical, ids, rewards, segments)
    successes = jax.ops.segment_sum(rewards, segments, num_prompts)
    metrics = allocation.rollout_metrics(alloc, successes, log_p, estimated=not exact)
    # Tunix's rewards/score/mean weights each prompt by its rollouts; this does not.
    sampled = alloc.counts > 0
    rates = successes / jnp.maximum(alloc.counts, 1)
    metrics["rewards/prompt_mean"] = (jnp.sum(jnp.where(sampled, rates, 0.0))
                                      / jnp.maximum(jnp.sum(sampled), 1))
    if not exact:
      seen = historical.seen[ids]
      metrics["p_estimate/unseen_fraction"] = 1.0 - jnp.mean(seen.astype(jnp.float32))
    return weighted, mask.astype(stock_mask.dtype), staged, metrics

  # ---- alignment with the exact gradient ----------------------------------------------------

  def alignment(self, batch: dict[str, np.ndarray], alloc: allocation.Allocation,
                train_slices) -> dict[str, float]:
    """Cosines with the exact gradient g* = (1/M) sum_q grad log p_q (the classification names).

    * cos/realized: the step's realized ascent gradient, minus the gradient of
      the very loss Tunix trains on, averaged over the train micro-batches as
      its optimizer accumulates them;
    * cos/expected: its expectation g_E = (1/M) sum_q (w_q n_q / N0) c(p_q, n_q)
      grad log p_q at the step's counts and weights (docs/method.md#weights-and-the-loss; c from
      `expected_scale` of the configured estimator, p exact);
    * cos/uniform_expected: uniform MaxRL's at the same budget, c = kappa(p_q, N0);
    * norm_ratio/*: |g| / |g*| of each (a cosine is 0 where a gradient is 0);
    * exact_log_p/mean: the batch's mean exact log p, the objective g* ascends.

    The gradients come from `expected_gradients` and `realized_gradient`.
    """
    flat_grads = jnp.concatenate([self.expected_gradients(batch, alloc),
                                  self.realized_gradient(train_slices)[None]])
    gram = flat_grads @ flat_grads.T
    norms = jnp.sqrt(jnp.diag(gram))
    log_p = self.algo_config.exact_log_p(self.policy(self.rl_cluster.actor_trainer.model), batch)
    metrics = {"exact_log_p/mean": float(jnp.mean(log_p))}
    for row, name in ((1, "expected"), (2, "uniform_expected"), (3, "realized")):
      # 0 where a gradient is 0 (no group mixed), as in the classification setting.
      denominator = float(norms[0] * norms[row])
      metrics[f"cos/{name}"] = float(gram[0, row]) / denominator if denominator > 0 else 0.0
      metrics[f"norm_ratio/{name}"] = float(norms[row] / norms[0])
    return metrics

  def expected_gradients(self, batch: dict[str, np.ndarray],
                         alloc: allocation.Allocation) -> jax.Array:
    """[3, P] the exact gradient g*, the expected gradient g_E at `alloc`'s counts and
    weights, and uniform MaxRL's g_E at N0, flattened over the actor's parameters.

    Per prompt, each is a coefficient times grad log p_q (docs/method.md#weights-and-the-loss):
    1 / M; (w_q n_q / N0) c(p_q, n_q) / M with c = `expected_scale` of the
    configured estimator; kappa(p_q, N0) / M. So the three are pullbacks of one
    forward pass of the task's exact log p.
    """
    config = self.algo_config
    graph, params, rest = nnx.split(self.rl_cluster.actor_trainer.model, nnx.Param, ...)

    def log_p_of(params):
      return config.exact_log_p(self.policy(nnx.merge(graph, params, rest)), batch)

    log_p, vjp = jax.vjp(log_p_of, params)
    log_p = jax.lax.stop_gradient(log_p)
    n0 = config.baseline_n
    scale = estimators.expected_scale(config.allocation_config.estimator_spec, log_p,
                                      alloc.counts, max_n=config.n_max)
    uniform = estimators.expected_scale("maxrl", log_p, jnp.full_like(alloc.counts, n0),
                                        max_n=n0)
    expected = alloc.weights * alloc.counts / n0 * scale
    cotangents = jnp.stack([jnp.ones_like(log_p), expected, uniform]) / log_p.shape[0]
    # One pullback per cotangent: a jax.vmap over the pullback re-batches its backward pass
    # on every call (it is traced anew each step), 20x slower for the tiny decoder.
    return jnp.stack([jax.flatten_util.ravel_pytree(vjp(cotangent)[0])[0]
                      for cotangent in cotangents.astype(log_p.dtype)])

  def realized_gradient(self, train_slices) -> jax.Array:
    """[P] the step's ascent gradient: minus the gradient of the very loss Tunix trains on,
    averaged over the train micro-batches (as its optimizer accumulates them), flattened."""
    if self._loss_gradient is None:
      loss = tunix_compat.training_loss(self.rl_cluster.actor_trainer)
      self._loss_gradient = nnx.jit(nnx.grad(loss))
    model = self.rl_cluster.actor_trainer.model
    grads = [jax.flatten_util.ravel_pytree(self._loss_gradient(model, example))[0]
             for example in train_slices]
    return -sum(grads) / len(grads)

  # ---- the estimator's state inside the actor's checkpoints ---------------------------------

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
    saved = dict(tunix_compat.restored_metadata(trainer).get(ESTIMATOR_KEY) or {})
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


def device_memory_limit(devices) -> int | None:
  """The least memory (bytes_limit) any of `devices` reports, None when one does not (a CPU)."""
  limits = []
  for device in devices:
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
      return None
    limits.append(int(stats["bytes_limit"]))
  return min(limits) if limits else None


def _device_bytes(state) -> int:
  """Bytes one device holds of the arrays of `state` (the largest shard of each)."""
  return sum(int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
             for leaf in jax.tree.leaves(state) if isinstance(leaf, jax.Array))


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

