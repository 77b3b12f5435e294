"""Maze navigation as RL: supervised warm start, then SERA / uniform MaxRL / GRPO.

A fixed training set of mazes is visited in epochs of shuffled batches of M
mazes. The first `config.warmup_steps` steps minimise the negative
log-likelihood of the BFS shortest paths; every later step spends the same
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
offers an allocation log p alone (`INPUTS`): gvm would need each maze's gradient norm, and
adaptive sampling the outcomes of the rollouts before their counts are fixed.

All use the loss of docs/method.md#weights-and-the-loss with the allocation's prompt weights.
Rollouts live in a flat buffer of exactly B sequences with segment ids (the
maze of each rollout, `sera_jax.method.flat`), so counts vary and shapes never
do; advantages, the loss and the historical estimator's outcomes come from
segment sums over that buffer (docs/method.md#llm-post-training).

Batches, epochs and RNG depend only on the step number, so the state
(params, optimizer state, RNG, historical counts) is all a resume needs.

On a device mesh (`sera_jax.common.sharding`) the mazes of a warm-start batch
and the flat rollouts of an RL step or an evaluation are split along "data";
the state, the maze sets and the allocation are replicated, so every process
draws the same batches and counts and XLA all-reduces the gradients.
"""

import functools
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from sera_jax.common import optim, sharding
from sera_jax.common.evaluation import pass_at_k
from sera_jax.method import allocation, flat, registry, success, validation
from sera_jax.method.historical import historical_allocation
from sera_jax.settings.maze import env as maze_env
from sera_jax.settings.maze.plots import plot_runs
from sera_jax.settings.maze.policy import MazePolicy

INPUTS = ("log_p",)  # what the maze offers an allocation (`registry.AllocationInputs`)
PASS_AT_K = tuple(2**i for i in range(9))  # 1, 2, 4, ..., 256
_TRAIN_SET, _EVAL_SET, WARMUP_ORDER, RL_ORDER, _EVAL_KEY, _VALIDATION_SET, _VALIDATION_KEY = (
    range(7))


def maze_success_means(counts: jax.Array, successes: jax.Array, log_p_estimate: jax.Array
                       ) -> dict[str, jax.Array]:
  """The step's success rate per maze, over the whole batch and over the mazes rolled out.

  "reward/maze_mean" averages all M mazes, so every method is measured on the
  same set: a maze with rollouts counts its observed rate successes / counts,
  one without (SERA's inactive mazes) its success estimate exp(log_p_estimate).
  "reward/active_maze_mean" averages only the mazes with rollouts.

  Args:
    counts: int [M] rollouts of each maze.
    successes: [M] successes among them.
    log_p_estimate: [M] the estimate of log p the allocation used.
  """
  rolled_out = counts > 0
  observed = successes / jnp.maximum(counts, 1)
  return {
      "reward/maze_mean": jnp.mean(jnp.where(rolled_out, observed, jnp.exp(log_p_estimate))),
      "reward/active_maze_mean": jnp.sum(jnp.where(rolled_out, observed, 0.0))
                                 / jnp.maximum(jnp.sum(rolled_out), 1),
  }


class MazeState(NamedTuple):
  """Everything a maze run needs to resume exactly."""
  params: Any
  opt_state: Any
  rng: jax.Array
  historical: success.HistoricalState


def allocation_config(config: ml_collections.ConfigDict) -> registry.AllocationConfig:
  """The allocation of `config.method`: "grpo" (uniform counts with GRPO's advantages) or a
  registered mode the maze can feed (`registry.modes_fed_by(INPUTS)`). Its estimator is
  config.estimator with config.estimator_kwargs; "" (or no such key) is the method's, GRPO's
  for "grpo" and centered MaxRL's otherwise.

  Raises:
    ValueError: an unknown method or estimator, a mode the maze cannot feed, or a bad
      allocation value.
  """
  validation.choice("config.method", config.method, ("grpo", *registry.MODES))
  grpo = config.method == "grpo"
  mode = "uniform" if grpo else config.method
  registry.require(mode, INPUTS, who="the maze")
  estimator = config.get("estimator") or ("grpo" if grpo else "maxrl")
  if grpo and estimator != "grpo":
    raise ValueError(f"config.method 'grpo' scores with GRPO's advantages; for the estimator "
                     f"{estimator!r} with uniform counts set config.method to 'uniform'.")
  return registry.AllocationConfig.from_fields(config, prefix="config.", mode=mode,
                                               estimator=estimator)


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
  validation.integer("config.warmup_steps", config.warmup_steps, minimum=0)
  if config.warmup_steps > config.num_steps:
    raise ValueError(f"config.warmup_steps ({config.warmup_steps}) must be <= "
                     f"config.num_steps ({config.num_steps}).")
  microbatches = validation.integer("config.microbatches", config.microbatches, minimum=1)
  if (batch * config.baseline_n) % microbatches:
    raise ValueError(f"config.microbatches ({microbatches}) must divide the rollout budget "
                     f"batch_size * baseline_n = {batch * config.baseline_n}.")
  sharding.check_batch_divisible("config.batch_size", batch, num_devices)
  sharding.check_batch_divisible(
      "the rollouts of a microbatch, batch_size * baseline_n / microbatches,",
      batch * config.baseline_n // microbatches, num_devices)
  validation.choice("config.optimizer", config.optimizer, optim.OPTIMIZERS)
  for name in ("learning_rate", "warmup_learning_rate", "grad_clip_norm"):
    validation.real(f"config.{name}", config[name], positive=True)
  validation.integer("config.eval_samples", config.eval_samples, minimum=max(PASS_AT_K))
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


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Clipped Adam(W) or SGD; the warm start and RL phases have their own learning rate."""
  schedule = optax.join_schedules(
      [optax.constant_schedule(config.warmup_learning_rate),
       optax.constant_schedule(config.learning_rate)], [config.warmup_steps])
  return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm),
                     optim.make_optimizer(config, schedule))


def batch_ids(config: ml_collections.ConfigDict, index: int, order: int
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


def step_batch(config: ml_collections.ConfigDict, step: int) -> tuple[np.ndarray, bool | None]:
  """The maze ids of `step`'s batch, and whether it opens an RL epoch > 0 (None in the warm
  start): what `MazeTask.train_step` hands its warm-start or RL step."""
  if step < config.warmup_steps:
    return batch_ids(config, step, WARMUP_ORDER)[0], None
  return batch_ids(config, step - config.warmup_steps, RL_ORDER)


def _generate(key: jax.Array, count: int, size: int) -> jax.Array:
  return jax.vmap(lambda k: maze_env.generate(k, size))(jax.random.split(key, count))


def _generate_paths(mazes: jax.Array, max_steps: int) -> jax.Array:
  """The shortest path of every maze."""
  return jax.vmap(lambda m: maze_env.shortest_path(m, max_steps)[0])(mazes)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _generate_with_paths(key: jax.Array, count: int, size: int, max_steps: int
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(mazes, their shortest paths, their lengths in moves)."""
  mazes = _generate(key, count, size)
  paths, lengths = jax.vmap(lambda m: maze_env.shortest_path(m, max_steps))(mazes)
  return mazes, paths, lengths


class HeldOut(NamedTuple):
  """The held-out mazes and how their solutions relate to the training solutions.

  Attributes:
    mazes: bool [num_eval_mazes, size, size].
    candidates: mazes generated to find them.
    seen_fraction: fraction of the candidates whose shortest-path action
      sequence occurs among the training mazes' (what an unfiltered held-out
      set of this size would share with training).
  """
  mazes: jax.Array
  candidates: int
  seen_fraction: float


def held_out_mazes(key: jax.Array, count: int, size: int, max_steps: int,
                   train_paths: jax.Array, *, novel: bool, chunk: int = 256,
                   max_candidates: int = 1 << 16) -> HeldOut:
  """`count` held-out mazes, each solvable within `max_steps` moves; with `novel`, only
  mazes whose solution no training maze shares.

  A perfect maze has one shortest path, and a policy that replays training
  solutions solves exactly the held-out mazes whose path it replays
  (`replay_pass_at_k`); held-out mazes with unseen paths measure navigation,
  not memory. Candidates are drawn in chunks from `key` (deterministic); one whose shortest
  path is longer than `max_steps` (a config.max_steps set below the longest) is left out, as
  no rollout could solve it.

  Raises:
    ValueError: fewer than `count` such mazes among `max_candidates`.
  """
  if count == 0:
    return HeldOut(jnp.zeros((0, size, size), bool), 0, 0.0)
  seen = {row.tobytes() for row in np.asarray(train_paths)}
  kept, candidates, seen_count = [], 0, 0
  while len(kept) < count:
    if candidates >= max_candidates:
      raise ValueError(
          f"only {len(kept)} of {candidates} generated {size}x{size} mazes have a solution "
          f"within max_steps = {max_steps} moves{' that no training maze shares' * novel}; "
          f"lower num_eval_mazes or num_train_mazes, or raise maze_size or max_steps.")
    mazes, paths, lengths = jax.device_get(_generate_with_paths(
        jax.random.fold_in(key, candidates // chunk), chunk, size, max_steps))
    repeated = np.array([row.tobytes() in seen for row in paths])
    seen_count += int(repeated.sum())
    candidates += chunk
    kept.extend(mazes[(lengths <= max_steps) & (~repeated if novel else True)])
  return HeldOut(jnp.asarray(np.stack(kept[:count])), candidates, seen_count / candidates)


def replay_pass_at_k(train_paths: jax.Array, mazes: jax.Array, ks=PASS_AT_K) -> np.ndarray:
  """pass@k of the maze-blind replay policy: a training solution drawn uniformly (each
  training maze's path at its training frequency), whatever the maze.

  Its success probability on maze m is exact, p_m = mean_t reward(m, path_t),
  and so is its pass@k = mean_m 1 - (1 - p_m)^k.
  """
  solves = jax.vmap(lambda maze: jax.vmap(lambda path: maze_env.reward(maze, path))(
      train_paths))(mazes)
  p = np.asarray(jnp.mean(solves, axis=1), np.float64)[:, None]
  return np.mean(-np.expm1(np.asarray(ks)[None, :] * np.log1p(-np.minimum(p, 1.0))), axis=0)


@functools.lru_cache(maxsize=8)
def maze_sets(data_seed: int, maze_size: int, max_steps: int, num_train: int, num_eval: int,
              num_validation: int, novel_eval_paths: bool
              ) -> tuple[jax.Array, jax.Array, HeldOut, HeldOut]:
  """(training mazes, their shortest paths, held-out, validation) of a data seed.

  Every run of a data seed has the same sets: they are built once a process (the runs of a
  figure, the tasks of its batches) and shared, read-only.
  """
  data_key = jax.random.PRNGKey(data_seed)
  train_mazes = _generate(jax.random.fold_in(data_key, _TRAIN_SET), num_train, maze_size)
  train_paths, lengths = jax.vmap(lambda m: maze_env.shortest_path(m, max_steps))(train_mazes)
  if int(jnp.max(lengths)) > max_steps:
    raise ValueError(f"config.max_steps ({max_steps}) is shorter than a shortest path "
                     f"({int(jnp.max(lengths))} moves) of the training set.")
  held_out = held_out_mazes(jax.random.fold_in(data_key, _EVAL_SET), num_eval, maze_size,
                            max_steps, train_paths, novel=novel_eval_paths)
  # Validation mazes (to choose hyperparameters on) have shortest paths that neither a
  # training nor a held-out maze has.
  validation = held_out_mazes(
      jax.random.fold_in(data_key, _VALIDATION_SET), num_validation, maze_size, max_steps,
      jnp.concatenate([train_paths, _generate_paths(held_out.mazes, max_steps)]), novel=True)
  return train_mazes, train_paths, held_out, validation


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
    max_steps = config.max_steps or maze_env.max_path_length(config.maze_size) + 1
    self.policy = MazePolicy(config.maze_size, max_steps, config.dim, config.num_layers,
                             config.num_heads)
    train_mazes, train_paths, self.held_out, self.validation = maze_sets(
        config.data_seed, config.maze_size, max_steps, config.num_train_mazes,
        config.num_eval_mazes, config.get("num_validation_mazes", 0), config.novel_eval_paths)
    # Every process builds the same sets; the steps read them replicated on the mesh.
    self.train_mazes, self.train_paths, self.eval_mazes, self.validation_mazes = (
        sharding.replicate((train_mazes, train_paths, self.held_out.mazes,
                            self.validation.mazes), self.mesh))
    self.optimizer = make_optimizer(config) if optimizer is None else optimizer
    self._warmup_step = jax.jit(self.warmup_step_fn)
    self._rl_step = jax.jit(self.rl_step_fn)
    self._eval_successes = jax.jit(self.eval_successes_fn,
                                   out_shardings=sharding.replicated(self.mesh))

  # ---- protocol -------------------------------------------------------------------------------

  def init_state(self, rng: jax.Array) -> MazeState:
    params = self.policy.init(jax.random.fold_in(rng, 1))
    state = MazeState(params, self.optimizer.init(params), rng,
                      success.historical_init(self.config.num_train_mazes))
    return sharding.replicate(state, self.mesh)

  def train_step(self, state: MazeState, step: int) -> tuple[MazeState, dict[str, jax.Array]]:
    ids, new_epoch = step_batch(self.config, step)
    ids = sharding.replicate(ids, self.mesh)
    if new_epoch is None:
      return self._warmup_step(state, ids)
    return self._rl_step(state, ids, step, new_epoch)

  def evaluate(self, state: MazeState) -> dict[str, float]:
    """pass@k on the held-out mazes from config.eval_samples samples a maze, and as
    "validation/pass@k" on the validation mazes when the config has some."""
    successes = functools.partial(self._eval_successes, state.params, state.rng)
    return {name: float(values[0]) for name, values in
            self.pass_at_k(lambda *args: successes(*args)[None]).items()}

  def pass_at_k(self, successes) -> dict[str, np.ndarray]:
    """{"pass@k" and "validation/pass@k": [R]} of R policies whose successes on a slice of
    mazes are `successes(mazes, start, key_tag)`: int [R, eval_batch_size], as
    `eval_successes_fn` counts them for one."""
    sets = [(self.eval_mazes, _EVAL_KEY, "")]
    if self.config.get("num_validation_mazes", 0):
      sets.append((self.validation_mazes, _VALIDATION_KEY, "validation/"))
    metrics = {}
    for mazes, key_tag, prefix in sets:
      counts = np.concatenate(jax.device_get(
          [successes(mazes, start, key_tag)
           for start in range(0, mazes.shape[0], self.config.eval_batch_size)]), axis=1)
      values = np.stack([pass_at_k(run, self.config.eval_samples, PASS_AT_K) for run in counts])
      metrics |= {f"{prefix}pass@{k}": values[:, i] for i, k in enumerate(PASS_AT_K)}
    return metrics

  def write_figures(self, workdir: str, rows: list[dict]) -> None:
    """maze.png: training success rate over steps and the last pass@k curve."""
    plot_runs([(self.config.method, rows)], os.path.join(workdir, "maze.png"))

  # ---- steps ----------------------------------------------------------------------------------

  def _apply(self, state: MazeState, grads) -> tuple[Any, Any]:
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
    return optax.apply_updates(state.params, updates), opt_state

  def warmup_step_fn(self, state: MazeState, ids: jax.Array) -> tuple[MazeState, dict]:
    """Supervised step (unjitted): minimise the mean NLL of the BFS paths of a batch."""
    mazes = sharding.split_rows(self.train_mazes[ids], self.mesh)
    paths = sharding.split_rows(self.train_paths[ids], self.mesh)

    def nll(params):
      return -jnp.mean(self.policy.log_prob(params, mazes, paths[:, None])[:, 0])

    loss, grads = jax.value_and_grad(nll)(state.params)
    params, opt_state = self._apply(state, grads)
    return state._replace(params=params, opt_state=opt_state), {"loss": loss,
                                                                "warmup/nll": loss}

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
        **maze_success_means(alloc.counts, group_successes, log_p),
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
