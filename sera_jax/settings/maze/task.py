"""Maze navigation as RL: SERA / uniform MaxRL / GRPO from one supervised warm start.

Every run starts from the warm start of its data (`sera_jax.settings.maze.warm_start`:
imitation of BFS paths on a pool of mazes disjoint from the RL, validation and held-out sets,
the same for every seed and method). A fixed RL set of mazes (`sera_jax.settings.maze.sets`)
is then visited in epochs of shuffled batches of M mazes, every step spending the same
rollout budget B = M * N0:

* "uniform": N0 rollouts a maze, centered MaxRL advantages
  (docs/method.md#the-estimator-and-its-scale), or those of `config.estimator` (any
  registered estimator, its parameters in `config.estimator_kwargs`), as for every method
  but "grpo";
* "grpo":    N0 rollouts a maze, GRPO advantages;
* "sera":    counts from `allocate(mode="sera")` (docs/method.md#the-waterline to
  docs/method.md#the-active-set) on success probabilities from the historical estimator
  (docs/method.md#estimating-p, frozen within an epoch); the uniform allocation while no
  maze has an estimate (the first RL epoch);
* "equalized", "knapsack": those allocations (`sera_jax.method.registry`), on the same
  estimate and as uniform in the first RL epoch.

Every method's allocation is `sera_jax.method.historical.historical_allocation`. The maze
offers an allocation log p alone (`episodes.INPUTS`): gvm would need each maze's gradient norm, and
adaptive sampling the outcomes of the rollouts before their counts are fixed.

All use the loss of docs/method.md#weights-and-the-loss with the allocation's prompt weights.
Rollouts live in a flat buffer of exactly B sequences with segment ids (the
maze of each rollout, `sera_jax.method.flat`), so counts vary and shapes never
do; advantages, the loss and the historical estimator's outcomes come from
segment sums over that buffer (docs/method.md#llm-post-training).

Batches, epochs and RNG depend only on the step number, so the state
(params, optimizer state, RNG, historical counts) is all a resume needs.

Evaluation (`config.eval_sets`) scores pass@k, k = 1, 2, 4, ... up to config.eval_samples,
unbiased from config.eval_samples samples a maze: on the held-out mazes ("pass@k", and
"unseen_path/pass@k" on those whose shortest path no RL maze has) and on the validation mazes
("validation/pass@k"), which choose hyperparameters.

On a device mesh (`sera_jax.common.sharding`) the mazes of a warm-start batch
and the flat rollouts of an RL step or an evaluation are split along "data";
the state, the maze sets and the allocation are replicated, so every process
draws the same batches and counts and XLA all-reduces the gradients.
"""

import copy
import functools
import os
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
from sera_jax.settings.maze import env as maze_env
from sera_jax.settings.maze import sets as maze_sets
from sera_jax.settings.maze import warm_start
from sera_jax.settings.maze.plots import plot_runs
from sera_jax.settings.maze.policy import MazePolicy

EVAL_SETS = ("held_out", "validation")
RL_ORDER = 3  # seeds the batch order with the run's seed and data_seed
# Tags folded into a run's rng for its evaluation samples, one per set.
_EVAL_KEY, _VALIDATION_KEY, _RL_SET_KEY = 4, 6, 7


def allocation_config(config: ml_collections.ConfigDict) -> registry.AllocationConfig:
  """`episodes.allocation_config` of the maze."""
  return episodes.allocation_config(config, setting="the maze")


class MazeState(NamedTuple):
  """Everything a maze run needs to resume exactly."""
  params: Any
  opt_state: Any
  rng: jax.Array
  historical: success.HistoricalState


def validate_config(config: ml_collections.ConfigDict, num_devices: int = 1) -> None:
  """Rejects a bad config (for a mesh of `num_devices`) before anything is compiled."""
  allocation_config(config)
  validation.integer("config.data_seed", config.data_seed, minimum=0)
  maze_env.check_size(config.maze_size)
  validation.integer("config.max_steps", config.max_steps, minimum=0)
  batch = validation.integer("config.batch_size", config.batch_size, minimum=1)
  train = validation.integer("config.num_train_mazes", config.num_train_mazes, minimum=1)
  if train % batch:
    raise ValueError(f"config.num_train_mazes ({train}) must be a multiple of "
                     f"config.batch_size ({batch}): epochs are whole batches.")
  sft_batch = validation.integer("config.sft_batch_size", config.sft_batch_size, minimum=1)
  if validation.integer("config.num_sft_mazes", config.num_sft_mazes, minimum=0) % sft_batch:
    raise ValueError(f"config.num_sft_mazes ({config.num_sft_mazes}) must be a multiple of "
                     f"config.sft_batch_size ({sft_batch}): the warm start sees each once.")
  validation.integer("config.sft_seed", config.sft_seed, minimum=0)
  microbatches = validation.integer("config.microbatches", config.microbatches, minimum=1)
  if (batch * config.baseline_n) % microbatches:
    raise ValueError(f"config.microbatches ({microbatches}) must divide the rollout budget "
                     f"batch_size * baseline_n = {batch * config.baseline_n}.")
  sharding.check_batch_divisible("config.batch_size", batch, num_devices)
  sharding.check_batch_divisible(
      "the rollouts of a microbatch, batch_size * baseline_n / microbatches,",
      batch * config.baseline_n // microbatches, num_devices)
  validation.choice("config.optimizer", config.optimizer, optim.OPTIMIZERS)
  for name in ("learning_rate", "sft_learning_rate", "grad_clip_norm"):
    validation.real(f"config.{name}", config[name], positive=True)
  validation.integer("config.eval_samples", config.eval_samples, minimum=1)
  for name in config.eval_sets:
    validation.choice("config.eval_sets", name, EVAL_SETS)
  validation.integer("config.num_eval_mazes", config.num_eval_mazes, minimum=1)
  eval_batch = validation.integer("config.eval_batch_size", config.eval_batch_size, minimum=1)
  for name in ("num_eval_mazes", "num_validation_mazes"):
    if config.get(name, 0) % eval_batch:
      raise ValueError(f"config.{name} ({config[name]}) must be a multiple of "
                       f"config.eval_batch_size ({eval_batch}).")
  validation.integer("config.num_validation_mazes", config.get("num_validation_mazes", 0),
                     minimum=0)
  sharding.check_batch_divisible("config.eval_batch_size * config.eval_samples",
                                 eval_batch * config.eval_samples, num_devices)


# Clipped Adam(W) or SGD at the constant RL rate config.learning_rate (the warm start has its
# own, `warm_start.make_optimizer`).
make_optimizer = episodes.make_optimizer


def batch_ids(config: ml_collections.ConfigDict, index: int, order: int = RL_ORDER
              ) -> tuple[np.ndarray, bool]:
  """Maze ids of the index-th batch of shuffled epochs, and whether it opens an epoch > 0."""
  per_epoch = config.num_train_mazes // config.batch_size
  epoch, position = divmod(index, per_epoch)
  # The run's seed orders the batches (as it does for classification); data_seed
  # only builds the mazes, which every seed and method shares.
  permutation = np.random.default_rng(
      [config.seed, config.data_seed, order, epoch]).permutation(config.num_train_mazes)
  ids = permutation[position * config.batch_size:(position + 1) * config.batch_size]
  return ids.astype(np.int32), position == 0 and epoch > 0


def step_limit(config: ml_collections.ConfigDict) -> int:
  """The step limit T: config.max_steps, or (0) the longest possible shortest path + 1."""
  return config.max_steps or maze_env.max_path_length(config.maze_size) + 1


def config_sets(config: ml_collections.ConfigDict) -> maze_sets.MazeSets:
  """The maze sets of `config` (`sets.maze_sets`, built once a process)."""
  return maze_sets.maze_sets(
      config.data_seed, config.maze_size, step_limit(config), config.num_train_mazes,
      config.num_eval_mazes, config.num_validation_mazes, config.num_sft_mazes,
      config.sft_disjoint_paths)


class MazeTask:
  """The `sera_jax.harness.train.Task` of maze navigation."""

  def __init__(self, config: ml_collections.ConfigDict, *, mesh=None, optimizer=None):
    """A task of `config` on `mesh` (default `sharding.make_mesh()`: every device on "data")
    with `optimizer` (default `make_optimizer(config)`; a batch of runs passes one that reads
    each run's scalars from its state)."""
    self.mesh = sharding.make_mesh() if mesh is None else mesh
    validate_config(config, self.mesh.shape[sharding.DATA_AXIS])
    self.config = config
    self.allocation = allocation_config(config)
    self.ks = episodes.pass_at_ks(config.eval_samples)
    self.policy = MazePolicy(config.maze_size, step_limit(config), config.dim,
                             config.num_layers, config.num_heads)
    self.sets = config_sets(config)
    # Every process builds the same sets; the steps read them replicated on the mesh.
    self.train_mazes, self.train_paths, self.eval_mazes, self.validation_mazes = (
        sharding.replicate(tuple(jnp.asarray(x) for x in (
            self.sets.rl.mazes, self.sets.rl.paths, self.sets.held_out.mazes,
            self.sets.validation.mazes)), self.mesh))
    self.optimizer = make_optimizer(config) if optimizer is None else optimizer
    self._rl_step = jax.jit(self.rl_step_fn)
    self._eval_successes = jax.jit(self.eval_successes_fn,
                                   out_shardings=sharding.replicated(self.mesh))

  def warm_start(self) -> Any:
    """The parameters every run starts from (`warm_start.warm_start`, kept on disk in
    config.warm_start_dir when it names one)."""
    return warm_start.warm_start(self.policy, self.sets.sft.mazes, self.sets.sft.paths,
                                 self.config, self.config.warm_start_dir)

  # ---- protocol -------------------------------------------------------------------------------

  def init_state(self, rng: jax.Array) -> MazeState:
    params = self.warm_start()
    state = MazeState(params, self.optimizer.init(params), rng,
                      success.historical_init(self.config.num_train_mazes))
    return sharding.replicate(state, self.mesh)

  def train_step(self, state: MazeState, step: int) -> tuple[MazeState, dict[str, jax.Array]]:
    ids, new_epoch = batch_ids(self.config, step)
    return self._rl_step(state, sharding.replicate(ids, self.mesh), step, new_epoch)

  def evaluate(self, state: MazeState) -> dict[str, float]:
    """pass@k on the sets of config.eval_sets (see the module docstring)."""
    successes = functools.partial(self._eval_successes, state.params, state.rng)
    return {name: float(values[0]) for name, values in
            self.pass_at_k(lambda *args: successes(*args)[None]).items()}

  def successes(self, successes, mazes: jax.Array, key_tag: int) -> np.ndarray:
    """int [R, len(mazes)]: the successes among config.eval_samples samples of each maze of R
    policies, whose successes on a slice of eval_batch_size mazes are
    `successes(mazes, start, key_tag)` (as `eval_successes_fn` counts them for one)."""
    return np.concatenate(jax.device_get(
        [successes(mazes, start, key_tag)
         for start in range(0, mazes.shape[0], self.config.eval_batch_size)]), axis=1)

  def pass_at_k(self, successes) -> dict[str, np.ndarray]:
    """{"pass@k", "unseen_path/pass@k", "validation/pass@k": [R]} of the sets of
    config.eval_sets for R policies whose successes are `successes` (see `successes`)."""
    num_samples, metrics = self.config.eval_samples, {}

    def scores(counts, prefix):
      values = np.stack([pass_at_k(run, num_samples, self.ks) for run in counts])
      return {f"{prefix}pass@{k}": values[:, i] for i, k in enumerate(self.ks)}

    if "held_out" in self.config.eval_sets and self.eval_mazes.shape[0]:
      counts = self.successes(successes, self.eval_mazes, _EVAL_KEY)
      metrics |= scores(counts, "")
      if self.sets.unseen_path.any():
        metrics |= scores(counts[:, self.sets.unseen_path], "unseen_path/")
    if "validation" in self.config.eval_sets and self.validation_mazes.shape[0]:
      metrics |= scores(self.successes(successes, self.validation_mazes, _VALIDATION_KEY),
                        "validation/")
    return metrics

  def rl_set_success_rates(self, params, num_samples: int) -> np.ndarray:
    """float64 [num_train_mazes]: each RL maze's success rate among `num_samples` samples of
    the policy `params` (the spread of p that SERA allocates over)."""
    if self.config.num_train_mazes % self.config.eval_batch_size:
      raise ValueError(f"config.num_train_mazes ({self.config.num_train_mazes}) must be a "
                       f"multiple of config.eval_batch_size ({self.config.eval_batch_size}) "
                       f"to score the RL set.")
    config = self.config.copy_and_resolve_references()
    config.eval_samples = num_samples
    task = copy.copy(self)
    task.config = config
    count = jax.jit(task.eval_successes_fn)
    rng = jax.random.PRNGKey(self.config.sft_seed)
    counts = task.successes(lambda *args: count(params, rng, *args)[None], self.train_mazes,
                            _RL_SET_KEY)
    return counts[0] / num_samples

  def write_figures(self, workdir: str, rows: list[dict]) -> None:
    """maze.png: training success rate over steps and the last pass@k curve."""
    plot_runs([(self.config.method, rows)], os.path.join(workdir, "maze.png"))

  # ---- steps ----------------------------------------------------------------------------------

  def _apply(self, state: MazeState, grads) -> tuple[Any, Any]:
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
    return optax.apply_updates(state.params, updates), opt_state

  def rl_step_fn(self, state: MazeState, ids: jax.Array, step, new_epoch, scalars=None
                 ) -> tuple[MazeState, dict]:
    """RL step (unjitted) on the batch of mazes `ids`, its rollouts drawn from
    fold_in(state.rng, step); `new_epoch` whether the batch opens an epoch > 0. `scalars`
    ({field: value} of `registry.SCALARS`; a batch's run's own) replace the config's."""
    config = self.config
    num_prompts, budget = config.batch_size, config.batch_size * config.baseline_n
    historical, alloc, log_p = historical_allocation(self.allocation.replace(**scalars or {}),
                                                     state.historical, ids, new_epoch, True)
    has_estimate = historical.seen[ids]

    mazes = self.train_mazes[ids]
    prompt = sharding.split_rows(flat.rollout_segments(alloc.counts, budget), self.mesh)
    key = jax.random.fold_in(state.rng, step)
    actions, log_probs = self._sample(state.params, mazes, prompt, key)
    rewards = jax.vmap(maze_env.reward)(mazes[prompt], actions)
    in_episode = jax.vmap(maze_env.episode_mask)(mazes[prompt], actions)
    advantages = flat.flat_advantages(
        rewards, prompt, num_prompts=num_prompts,
        estimator=self.allocation.estimator_spec)
    historical = success.historical_stage_flat(historical, ids, rewards, prompt)

    # The loss is linear in the log-probabilities: its gradient is sum_b coef_b grad log pi_b,
    # accumulated over microbatches of rollouts so that memory does not grow with B.
    loss, coefficients = jax.value_and_grad(flat.flat_policy_loss)(
        log_probs, advantages, prompt, alloc.weights, baseline_n=config.baseline_n)
    chunks = lambda x: sharding.split_rows(  # noqa: E731
        x.reshape(config.microbatches, -1, *x.shape[1:]), self.mesh, axis=1)

    def accumulate(total, chunk):
      chunk_prompt, chunk_actions, chunk_coefficients = chunk
      grads = jax.grad(lambda params: jnp.sum(chunk_coefficients * self.policy.log_prob_rollouts(
          params, mazes, chunk_prompt, chunk_actions)))(state.params)
      return jax.tree.map(jnp.add, total, grads), None

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    grads, _ = jax.lax.scan(accumulate, zeros,
                            (chunks(prompt), chunks(actions), chunks(coefficients)))
    params, opt_state = self._apply(state, grads)

    group_successes = jax.ops.segment_sum(rewards, prompt, num_prompts)
    metrics = allocation.rollout_metrics(alloc, group_successes, log_p, estimated=True) | {
        "loss": loss,
        "reward/mean": jnp.mean(rewards),  # over rollouts: SERA weights hard mazes up
        **episodes.success_means(alloc.counts, group_successes, log_p, prompt="maze"),
        "estimated_fraction": jnp.mean(has_estimate),
        "episode_length": jnp.mean(jnp.sum(in_episode, axis=1)),
    }
    state = MazeState(params, opt_state, state.rng, historical)
    return state, metrics

  def _sample(self, params, mazes: jax.Array, prompt: jax.Array, key: jax.Array
              ) -> tuple[jax.Array, jax.Array]:
    """The B flat rollouts, sampled config.microbatches chunks at a time (`jax.lax.map`).

    Only B / microbatches rollouts' decoding cache and logits exist at once; each
    rollout draws from its own index, so the draws do not depend on the chunking.
    """
    chunks = self.config.microbatches
    split = lambda x: sharding.split_rows(x.reshape(chunks, -1), self.mesh, axis=1)  # noqa: E731
    actions, log_probs = jax.lax.map(
        lambda chunk: self.policy.sample_rollouts(params, mazes, chunk[0], key, chunk[1]),
        (split(prompt), split(jnp.arange(prompt.shape[0]))))
    return actions.reshape(prompt.shape[0], -1), log_probs.reshape(-1)

  def eval_successes_fn(self, params, rng: jax.Array, mazes: jax.Array, start: int,
                        key_tag: int) -> jax.Array:
    """Successes among config.eval_samples samples of each of the eval_batch_size `mazes`
    from `start`, int32 [eval_batch_size]; the samples are split over the mesh and drawn
    from `rng` folded with `key_tag` (one per evaluation set) and `start`."""
    config = self.config
    mazes = jax.lax.dynamic_slice_in_dim(mazes, start, config.eval_batch_size)
    maze_ids = sharding.split_rows(
        jnp.repeat(jnp.arange(config.eval_batch_size), config.eval_samples), self.mesh)
    key = jax.random.fold_in(jax.random.fold_in(rng, key_tag), start)
    actions, _ = self.policy.sample_rollouts(params, mazes, maze_ids, key)
    rewards = jax.vmap(maze_env.reward)(mazes[maze_ids], actions)
    return jnp.sum(rewards.reshape(config.eval_batch_size, -1), axis=1).astype(jnp.int32)
