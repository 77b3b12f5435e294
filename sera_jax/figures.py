"""Shared machinery of the gradient-alignment figure scripts in experiments/ (issue 4).

* Snapshots: a `sera_jax.train.run` of a classification config checkpointed at
  every epoch boundary (`train_for_snapshots`), restored by step
  (`load_state`); early / midway / late are epoch boundaries
  (`snapshot_steps`), so the historical estimate (DESIGN §1.5) can be rebuilt
  from the checkpoints of the epochs before each one (`historical_log_p`).
* Methods: how a batch becomes a gradient estimate. A `Method` holds an
  allocation function (key, logits, labels) -> `Allocation` plus the static
  normalisation and width of its rollouts; `oracle_method`,
  `estimate_method` and `pilot_method` build the allocations the figures
  compare.
* `make_evaluator`: for a fixed batch and any set of methods, ONE jitted call
  draws every seed's rollouts (`jax.vmap` over keys), stacks the exact,
  realized and expected logit cotangents (DESIGN §2), pushes them through one
  `jax.vjp` and returns each estimate's cosine with the exact gradient from
  their Gram matrix (`classification.gram_matrix` / `classification.cosines`).
"""

import argparse
import csv
import functools
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from scipy import stats

from sera_jax import allocation, classification, success, train
from sera_jax.allocation import Allocation
from sera_jax.classification_task import ClassificationTask, TrainState
from sera_jax.cli import DEFAULT_CONFIG
from sera_jax.config import load as load_config

# (key, logits, labels, extras) -> Allocation; extras: per-batch inputs given to the evaluator.
AllocateFn = Callable[[jax.Array, jax.Array, jax.Array, Mapping[str, jax.Array]], Allocation]


# ----------------------------------------------------------------------------- snapshots


def snapshot_steps(num_steps: int, steps_per_epoch: int) -> dict[str, int]:
  """Early, midway and late epoch boundaries of a run: after epoch 1, at half, the last one."""
  last = (num_steps // steps_per_epoch) * steps_per_epoch
  if last < steps_per_epoch:
    raise ValueError(f"a run of {num_steps} steps does not finish one epoch of "
                     f"{steps_per_epoch} steps; train longer.")
  middle = max(round(num_steps / 2 / steps_per_epoch), 1) * steps_per_epoch
  return {"early": steps_per_epoch, "mid": middle, "late": last}


def train_for_snapshots(config: ml_collections.ConfigDict, workdir: str) -> ClassificationTask:
  """Runs (or resumes, or finds finished) `config` in `workdir` with a checkpoint per epoch.

  Returns the task, whose model and dataset the evaluations use.
  """
  task = ClassificationTask(config)
  steps_per_epoch = task.dataset.steps_per_epoch(config.batch_size)
  config.checkpoint_every = steps_per_epoch
  config.checkpoints_to_keep = config.num_steps // steps_per_epoch + 2
  train.check_same_run(config, workdir)
  train.run(config, workdir, task=task)
  return task


def load_state(task: ClassificationTask, workdir: str, step: int) -> TrainState:
  """The training state after `step` steps (step 0: the initial state)."""
  state = task.init_state(jax.random.PRNGKey(task.config.seed))
  if step == 0:
    return state
  path = os.path.abspath(os.path.join(workdir, train.CHECKPOINT_DIR))
  with ocp.CheckpointManager(path) as manager:
    if step not in manager.all_steps():
      raise FileNotFoundError(f"no checkpoint of step {step} in {path}; it holds "
                              f"{sorted(manager.all_steps())}.")
    return manager.restore(step, args=ocp.args.StandardRestore(state))


class EvalBatch(NamedTuple):
  """Fixed training prompts: ids into the training set, images and labels."""
  ids: np.ndarray
  images: np.ndarray
  labels: np.ndarray


def evaluation_batches(dataset, batch_size: int, num_batches: int, seed: int = 0
                       ) -> list[EvalBatch]:
  """`num_batches` disjoint fixed batches of training prompts (an in-memory dataset)."""
  if not hasattr(dataset, "train_images"):
    raise ValueError(f"the figure scripts need an in-memory dataset (digits, synthetic); "
                     f"{dataset.name!r} is streamed.")
  if batch_size * num_batches > dataset.num_train:
    raise ValueError(f"{num_batches} batches of {batch_size} exceed the {dataset.num_train} "
                     f"training examples.")
  order = np.random.default_rng(seed).permutation(dataset.num_train)
  batches = []
  for i in range(num_batches):
    ids = order[i * batch_size:(i + 1) * batch_size]
    batches.append(EvalBatch(ids, dataset.train_images[ids], dataset.train_labels[ids]))
  return batches


def forward_logits(task: ClassificationTask, state: TrainState, images) -> jax.Array:
  """Training-mode logits, as in the training step."""
  logits, _ = task.model.apply(state.params, state.batch_stats, images, train=True)
  return logits


def add_run_arguments(parser: argparse.ArgumentParser, *, seeds: int | None) -> None:
  """The arguments the figure scripts share: the training run, the output, the seeds (if any)."""
  parser.add_argument("--config", default=str(DEFAULT_CONFIG),
                      help="classification config of the run whose snapshots are evaluated")
  parser.add_argument("--method", default="ce", choices=("ce", "sera", "uniform", "equalized"),
                      help="update rule of that run (default ce: the exact gradient, a "
                      "trajectory that favours none of the compared estimators)")
  parser.add_argument("--num-steps", type=int, help="override config.num_steps")
  parser.add_argument("--batch-size", type=int, help="override config.batch_size (M)")
  parser.add_argument("--workdir", help="training run directory (default runs/figures-...)")
  parser.add_argument("--out", default="docs/figures", help="directory of the PNG and CSV")
  if seeds is not None:
    parser.add_argument("--seeds", type=int, default=seeds, help="sampling seeds per point")


def prepare_run(args: argparse.Namespace) -> tuple[ClassificationTask, str, dict[str, int]]:
  """Loads the config, trains (or resumes) the run and returns (task, workdir, snapshots)."""
  config = load_config(args.config)
  config.method = args.method
  config.align_every = 10  # the run's own alignment.png; the figures measure their own
  if args.num_steps is not None:
    config.num_steps = args.num_steps
  if args.batch_size is not None:
    config.batch_size = args.batch_size
  workdir = args.workdir or os.path.join(
      "runs", f"figures-{pathlib.Path(args.config).stem}-{config.method}-{config.num_steps}steps"
      f"-m{config.batch_size}")
  try:
    task = train_for_snapshots(config, workdir)
  except ValueError as error:  # e.g. the workdir holds a run of another config
    raise SystemExit(f"error: {error}") from None
  steps = snapshot_steps(config.num_steps, task.dataset.steps_per_epoch(config.batch_size))
  return task, workdir, steps


# ----------------------------------------------------------------------------- methods


class Method(NamedTuple):
  """A gradient estimator of the DESIGN §1.4 loss: an allocation and how it is scored.

  Attributes:
    allocate: (key, logits, labels, extras) -> `Allocation` of the (second-stage)
      rollouts; `extras` are the per-batch arrays passed to the evaluator.
    baseline_n: the N0 normalising the loss (§1.4) of those rollouts.
    max_rollouts: static padded width of the rollouts (>= every count).
    estimator: an `estimators.ESTIMATORS` name.
    random_allocation: True when the allocation depends on the key (a pilot);
      then every seed has its own allocation and its own expected gradient.
  """
  allocate: AllocateFn
  baseline_n: int
  max_rollouts: int
  estimator: str = "maxrl"
  random_allocation: bool = False


def _allocator(log_p_fn, *, baseline_n, n_min, n_max, mode, **options) -> AllocateFn:
  def allocate(key, logits, labels, extras):
    return allocation.allocate(jax.lax.stop_gradient(log_p_fn(key, logits, labels, extras)),
                               baseline_n=baseline_n, n_min=n_min, n_max=n_max, mode=mode,
                               **options)
  return allocate


def oracle_method(*, baseline_n: int, n_min: int, n_max: int, mode: str = "sera",
                  estimator: str = "maxrl", **options) -> Method:
  """Allocation on the exact p (§1.5 oracle). `options`: threshold, normalize_by_*."""
  oracle = lambda key, logits, labels, extras: success.oracle_log_p(logits, labels)  # noqa: E731
  allocate = _allocator(oracle, baseline_n=baseline_n, n_min=n_min, n_max=n_max, mode=mode,
                        **options)
  return Method(allocate, baseline_n,
                allocation.max_count(mode, baseline_n=baseline_n, n_max=n_max), estimator)


def estimate_method(extra: str, *, baseline_n: int, n_min: int, n_max: int,
                    mode: str = "sera", estimator: str = "maxrl", **options) -> Method:
  """Allocation on an estimate of log p given per batch as `extras[extra]` (e.g. historical)."""
  given = lambda key, logits, labels, extras: extras[extra]  # noqa: E731
  allocate = _allocator(given, baseline_n=baseline_n, n_min=n_min, n_max=n_max, mode=mode,
                        **options)
  return Method(allocate, baseline_n,
                allocation.max_count(mode, baseline_n=baseline_n, n_max=n_max), estimator)


def pilot_method(num_pilot: int, *, baseline_n: int, n_min: int, n_max: int,
                 mode: str = "sera", estimator: str = "maxrl", **options) -> Method:
  """Two-stage SERA (§1.5 pilot): num_pilot rollouts per prompt estimate p, the rest is allocated.

  The pilot spends M * num_pilot of the budget M * baseline_n only on the
  estimate; the gradient uses the independent second stage, allocated with
  `success.pilot_budget_split(baseline_n, num_pilot)` rollouts per prompt on
  average and normalised by that baseline.
  """
  rest = success.pilot_budget_split(baseline_n, num_pilot)

  def pilot_log_p(key, logits, labels, extras):
    counts = jnp.full(labels.shape, num_pilot, jnp.int32)
    pilot = classification.sample_rollouts(key, logits, labels, counts, max_rollouts=num_pilot)
    return success.pilot_log_p(jnp.sum(pilot.rewards, axis=1), num_pilot)

  allocate = _allocator(pilot_log_p, baseline_n=rest, n_min=n_min, n_max=n_max, mode=mode,
                        **options)
  return Method(allocate, rest, allocation.max_count(mode, baseline_n=rest, n_max=n_max),
                estimator, random_allocation=True)


# ----------------------------------------------------------------------------- evaluation


class Alignment(NamedTuple):
  """Cosines with the exact gradient of one method on one batch.

  Attributes:
    realized: [S] cosine of each seed's realized gradient.
    expected: [S] cosine of the expected gradient given each seed's allocation
      (all equal unless the allocation is random).
    norm_ratio: [S] |expected| / |exact| (cosines ignore a common scale; this does not).
    active_fraction: [S] fraction of prompts with rollouts.
  """
  realized: jax.Array
  expected: jax.Array
  norm_ratio: jax.Array
  active_fraction: jax.Array


def _seed_allocations(method: Method, allocation_keys, logits, labels, extras) -> Allocation:
  """The [S, M] allocation of every seed (one allocation, broadcast, unless it is random)."""
  if method.random_allocation:
    return jax.vmap(lambda key: method.allocate(key, logits, labels, extras))(allocation_keys)
  alloc = method.allocate(allocation_keys[0], logits, labels, extras)
  num_seeds = allocation_keys.shape[0]
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_seeds, *jnp.shape(x))), alloc)


def _cotangents(methods: Mapping[str, Method], keys, logits, labels, extras):
  """Per method: realized [S, M, C] and expected [S, or 1, M, C] cotangents, and allocations.

  Seed i allocates with split(keys[i])[0] (used only by random allocations)
  and samples with split(keys[i])[1], for every method (common random numbers).
  Methods with the same estimator are sampled in one vmap over (method, seed),
  padded to their widest rollouts: padding is masked out and the draws of a
  row are prefixes of a wider row's draws, so the result does not depend on
  which methods share the call, and compilation is paid once per estimator.
  """
  allocation_keys, sample_keys = jax.vmap(jax.random.split, out_axes=1)(keys)
  allocs = {name: _seed_allocations(method, allocation_keys, logits, labels, extras)
            for name, method in methods.items()}
  realized, expected = {}, {}
  for estimator in sorted({method.estimator for method in methods.values()}):
    group = [name for name, method in methods.items() if method.estimator == estimator]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *[allocs[name] for name in group])
    baselines = jnp.asarray([methods[name].baseline_n for name in group], logits.dtype)
    width = max(methods[name].max_rollouts for name in group)

    def realize(alloc, baseline_n, key, estimator=estimator, width=width):
      cotangent, _, _ = classification.sample_and_score(
          key, logits, labels, alloc, baseline_n=baseline_n, estimator=estimator,
          max_rollouts=width)
      return cotangent

    def expect(alloc, baseline_n, estimator=estimator, width=width):
      return classification.expected_logit_grad(logits, labels, alloc, baseline_n=baseline_n,
                                                estimator=estimator, max_rollouts=width)

    over_seeds = jax.vmap(realize, in_axes=(0, None, 0))
    realized_rows = jax.vmap(over_seeds, in_axes=(0, 0, None))(stacked, baselines, sample_keys)
    expected_rows = jax.vmap(jax.vmap(expect, in_axes=(0, None)))(stacked, baselines)
    for index, name in enumerate(group):
      realized[name] = realized_rows[index]
      random = methods[name].random_allocation
      expected[name] = expected_rows[index] if random else expected_rows[index, :1]
  return realized, expected, allocs


def make_evaluator(task: ClassificationTask, methods: Mapping[str, Method]):
  """One jitted call: (state, images, labels, keys [S], extras={}) -> {name: `Alignment`}.

  All seeds and all methods share one forward pass and one `jax.vjp`: the
  exact cotangent, then per method S realized and S (or 1) expected
  cotangents, are stacked and pushed through `jax.vmap(vjp_fn)` (DESIGN §2).
  """
  names = list(methods)

  def evaluate(state, images, labels, keys, extras=None):
    extras = {} if extras is None else extras
    forward = lambda p: task.model.apply(p, state.batch_stats, images, train=True)  # noqa: E731
    logits, vjp_fn, _ = jax.vjp(forward, state.params, has_aux=True)
    realized, expected, allocs = _cotangents(methods, keys, logits, labels, extras)
    rows = [classification.exact_logit_grad(logits, labels)[None]]
    for name in names:
      rows += [realized[name], expected[name]]
    (grads,) = jax.vmap(vjp_fn)(jnp.concatenate(rows))
    gram = classification.gram_matrix(grads)
    with_exact = classification.cosines(gram)[0]
    norms = jnp.sqrt(jnp.diag(gram))
    num_seeds = keys.shape[0]
    broadcast = lambda x: jnp.broadcast_to(x, (num_seeds,))  # noqa: E731
    results, first = {}, 1
    for name in names:
      realized_rows = slice(first, first + num_seeds)
      expected_rows = slice(first + num_seeds, first + num_seeds + expected[name].shape[0])
      first = expected_rows.stop
      results[name] = Alignment(
          realized=with_exact[realized_rows],
          expected=broadcast(with_exact[expected_rows]),
          norm_ratio=broadcast(norms[expected_rows] / norms[0]),
          active_fraction=jnp.mean(allocs[name].active, axis=-1))
    return results

  return jax.jit(evaluate)


def seed_keys(seed: int, num_seeds: int) -> jax.Array:
  """The sampling keys of seeds 0..num_seeds-1 (shared by every method and point)."""
  return jax.random.split(jax.random.PRNGKey(seed), num_seeds)


# ----------------------------------------------------------------------------- historical p


def historical_log_p(task: ClassificationTask, workdir: str, steps: Sequence[int], *,
                     discount: float = 0.75, seed: int = 0) -> dict[int, jax.Array]:
  """The frozen historical estimates (DESIGN §1.5) of every training prompt at epoch boundaries.

  Replays the epochs before max(steps) over the whole training set once:
  epoch e rolls out every training prompt with the policy of the checkpoint
  at its start (epoch 0 with the uniform allocation, as nothing is seen yet;
  later epochs with SERA on the frozen estimate; budget num_train * N0),
  stages the outcomes and folds them in at the boundary. Within-epoch policy
  drift is ignored (the epoch's first policy plays the whole epoch).

  Returns:
    {step: log_p [num_train]} for each step of `steps`, indexed by training-set id.
  """
  config = task.config
  dataset = task.dataset
  steps_per_epoch = dataset.steps_per_epoch(config.batch_size)
  if any(step % steps_per_epoch or step <= 0 for step in steps):
    raise ValueError(f"steps {list(steps)} must be positive epoch boundaries "
                     f"(epochs of {steps_per_epoch} steps).")
  all_ids = jnp.arange(dataset.num_train)
  images, labels = jnp.asarray(dataset.train_images), jnp.asarray(dataset.train_labels)

  @functools.partial(jax.jit, static_argnames="mode")
  def replay_epoch(history, state, key, mode):
    logits = forward_logits(task, state, images)
    estimate, _ = success.historical_estimate(history, all_ids)
    counts = allocation.allocate_from_config(estimate, config, mode).counts
    rollouts = classification.sample_rollouts(key, logits, labels, counts,
                                              max_rollouts=config.n_max)
    history = success.historical_stage(history, all_ids, rollouts.rewards, rollouts.mask)
    return success.historical_start_epoch(history, discount=discount)

  history = success.historical_init(dataset.num_train)
  estimates = {}
  for epoch in range(max(steps) // steps_per_epoch):
    state = load_state(task, workdir, epoch * steps_per_epoch)
    key = jax.random.fold_in(jax.random.PRNGKey(seed), epoch)
    # Epoch 0 gives every prompt N0 rollouts, so from epoch 1 on all have an estimate.
    history = replay_epoch(history, state, key, "sera" if epoch else "uniform")
    if (epoch + 1) * steps_per_epoch in steps:
      estimates[(epoch + 1) * steps_per_epoch] = success.historical_estimate(history, all_ids)[0]
  return estimates


# ----------------------------------------------------------------------------- reporting


def mean_interval(values: np.ndarray, axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
  """Mean and half-width of its 95% Student-t interval along `axis`."""
  values = np.asarray(values, dtype=np.float64)
  count = values.shape[axis]
  if count < 2:
    return values.mean(axis), np.zeros_like(values.mean(axis))
  half = stats.t.ppf(0.975, count - 1) * values.std(axis, ddof=1) / np.sqrt(count)
  return values.mean(axis), half


def write_csv(path: str, rows: Sequence[Mapping[str, Any]]) -> None:
  """Writes dict rows (keys of the first row as the header)."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)


def per_seed_rows(columns: Mapping[str, Any], values, seeds: Sequence[int], ks: Sequence[int],
                  *, digits: int) -> list[dict[str, Any]]:
  """One row per k: `columns`, k, the mean and std over seeds and each seed's value.

  Args:
    columns: the leading columns shared by the rows (e.g. {"method": "sera"}).
    values: [S, K] one value per seed and k.
    seeds: the S seeds (column names seed<s>).
    ks: the K values of k.
    digits: decimals written.
  """
  values = np.asarray(values)
  number = lambda v: f"{v:.{digits}f}"  # noqa: E731
  return [{**columns, "k": k, "mean": number(column.mean()), "std": number(column.std()),
           **{f"seed{s}": number(v) for s, v in zip(seeds, column, strict=True)}}
          for k, column in zip(ks, values.T, strict=True)]


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A fixed-width text table (floats with 4 decimals)."""
  cells = [[f"{v:.4f}" if isinstance(v, float) else str(v) for v in row] for row in rows]
  widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
  line = lambda row: "  ".join(str(v).rjust(w) for v, w in zip(row, widths, strict=True))  # noqa: E731
  return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, cells)])
