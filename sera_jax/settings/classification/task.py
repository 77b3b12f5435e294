"""Classification as RL with exact-gradient alignment at every step.

See docs/method.md#classification-as-rl.

Every `config.align_every` steps the training step runs one forward pass and
pushes the exact, SERA and uniform-MaxRL logit cotangents (realized and
expected, same batch, same budget B = M * N0) through one `jax.vjp`, and
reports their cosines with the exact likelihood gradient. The update follows
`config.method`: "ce" the exact gradient, "sera" / "uniform" / "equalized" or a
baseline allocator ("knapsack", "gvm", "adaptive"; `allocations`) the realized
estimate with that allocation mode. Other steps push only the
method's cotangent (the cost of a plain cross-entropy step plus allocation
and sampling); their rows carry no cosines.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

from sera_jax.common import sharding
from sera_jax.common.data import get_dataset
from sera_jax.common.models import create_model
from sera_jax.common.optim import learning_rate_schedule, make_optimizer
from sera_jax.method import allocation, allocators, estimators, registry, scaling, validation
from sera_jax.method.success import oracle_log_p
from sera_jax.settings.classification import allocations, gradients
from sera_jax.settings.classification.plots import plot_alignment

METHODS = ("ce", *allocations.MODES)
PASS_AT_K = tuple(2**i for i in range(11))  # 1, 2, 4, ..., 1024
# The cotangents pushed back through the one forward pass of an alignment step.
ALIGNED = ("exact", "sera_realized", "sera_expected", "uniform_realized", "uniform_expected")


class TrainState(NamedTuple):
  """Everything a classification run needs to resume exactly."""
  params: Any
  batch_stats: Any
  opt_state: Any
  rng: jax.Array


def init_train_state(model, optimizer: optax.GradientTransformation, rng: jax.Array
                     ) -> TrainState:
  """The initial state: parameters and batch statistics from fold_in(rng, 1), the RNG kept."""
  params, batch_stats = model.init(jax.random.fold_in(rng, 1))
  return TrainState(params, batch_stats, optimizer.init(params), rng)


def validate_config(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Rejects a bad config before anything is compiled."""
  validation.choice("config.method", config.method, METHODS)
  allocations.allocation_config(config, _stats_mode(config.method))
  validation.integer("config.batch_size", config.batch_size, minimum=1)
  validation.integer("config.eval_batch_size", config.eval_batch_size, minimum=1)
  validation.integer("config.align_every", config.align_every, minimum=1)
  for name in ("batch_size", "eval_batch_size"):
    sharding.check_batch_divisible(f"config.{name}", config[name], num_devices)


def _stats_mode(method: str) -> str:
  """The allocation the rollout statistics describe: the trained one; "ce" reports SERA's."""
  return "sera" if method == "ce" else method


def _width(config, mode):
  return allocation.max_count(mode, baseline_n=config.baseline_n, n_max=config.n_max)


def _rollout_metrics(alloc, rollouts, log_p):
  """Statistics of the trained allocation and its sampled groups."""
  quantiles = jnp.quantile(jnp.exp(log_p), jnp.array([0.1, 0.5, 0.9]))
  return allocation.rollout_metrics(alloc, jnp.sum(rollouts.rewards, axis=1), log_p) | {
      "p/q10": quantiles[0], "p/q50": quantiles[1], "p/q90": quantiles[2],
  }


def _surrogate_loss(logits, rollouts, advantages, alloc, baseline_n):
  log_probs = jnp.take_along_axis(jax.nn.log_softmax(logits), rollouts.actions, axis=1)
  return estimators.policy_loss(log_probs, advantages, rollouts.mask, alloc.weights, baseline_n)


def make_train_step(model, optimizer, config, *, align: bool, mesh=None, learning_rate=None,
                    runs_loop_on_cpu: bool = False):
  """The jitted step: (state, images, labels, step) -> (state, metrics).

  With a `mesh` (batch sharded on "data"), log p is gathered once and every device
  solves the allocation on the whole batch: the budget is global, no collective runs
  inside the allocator's loops, and the counts are those of a single-device run.
  `learning_rate(opt_state, step)` is the rate the metrics report, default the config's
  schedule (a batch of runs reads each run's own from its optimizer state). A fifth
  argument, {field: value} of `registry.SCALARS` (a batch's run's own), replaces the config's.
  `runs_loop_on_cpu` is for a step that a batch vmaps over its runs without a mesh: on the
  CPU, a batch with many rollouts in all samples them one run after another
  (`gradients.sample_and_score_in_slices`).
  """

  def allocate(mode, logits, labels, key, scalars):
    mode_config = allocations.allocation_config(config, mode).replace(**scalars)
    batch = allocations.inputs(mode_config, logits, labels, key)
    solve = functools.partial(registry.allocate_with, mode_config)
    return solve(batch) if mesh is None else sharding.on_every_device(solve, mesh)(batch)

  method = config.method
  stats_mode = _stats_mode(method)
  if learning_rate is None:
    schedule = learning_rate_schedule(config)
    learning_rate = lambda opt_state, step: schedule(step)  # noqa: E731
  # config.estimator with config.estimator_kwargs: every mode scores with it, and the
  # expected gradients take its c(p, n).
  estimator = allocations.allocation_config(config, stats_mode).estimator_spec

  sample_and_score = (gradients.sample_and_score_in_slices if runs_loop_on_cpu
                      else gradients.sample_and_score)

  def realized(key, logits, labels, alloc, mode):
    return sample_and_score(
        key, logits, labels, alloc, baseline_n=config.baseline_n, estimator=estimator,
        max_rollouts=_width(config, mode))

  def expected(logits, labels, alloc, mode):
    return gradients.expected_logit_grad(
        logits, labels, alloc, baseline_n=config.baseline_n, estimator=estimator,
        max_rollouts=_width(config, mode))

  def step_fn(state, images, labels, step, scalars=None):
    scalars = scalars or {}
    key = jax.random.fold_in(state.rng, step)
    keys = dict(zip(("sera", "uniform", "equalized"), jax.random.split(key, 3), strict=True))
    keys |= {mode: jax.random.fold_in(key, 3 + i) for i, mode in enumerate(allocators.MODES)}
    forward = lambda p: model.apply(p, state.batch_stats, images, train=True)  # noqa: E731
    logits, vjp_fn, batch_stats = jax.vjp(forward, state.params, has_aux=True)
    log_p = oracle_log_p(logits, labels)
    exact = gradients.exact_logit_grad(logits, labels)

    allocs = {} if method == "ce" else {
        method: allocate(method, logits, labels, keys[method], scalars)}
    if align:
      for mode in ("sera", "uniform"):
        allocs.setdefault(mode, allocate(mode, logits, labels, keys[mode], scalars))
    sampled = {mode: realized(keys[mode], logits, labels, alloc, mode)
               for mode, alloc in allocs.items()}

    cotangents = {"exact": exact} | {f"{m}_realized": s[0] for m, s in sampled.items()}
    if align:
      cotangents |= {f"{m}_expected": expected(logits, labels, allocs[m], m)
                     for m in ("sera", "uniform")}
    update_name = "exact" if method == "ce" else f"{method}_realized"
    names = list(ALIGNED) if align else []
    names += [update_name] if update_name not in names else []
    (grads,) = gradients.stacked_vjp(vjp_fn, [cotangents[n] for n in names])
    ascent = jax.tree.map(lambda g: g[names.index(update_name)], grads)
    descent = jax.tree.map(jnp.negative, ascent)
    updates, opt_state = optimizer.update(descent, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)

    cross_entropy = -jnp.mean(log_p)
    metrics = {
        "loss": cross_entropy,
        "cross_entropy": cross_entropy,
        "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels),
        "grad_norm": optax.tree.norm(ascent),
        "learning_rate": learning_rate(state.opt_state, step),
    }
    if stats_mode in sampled:
      _, rollouts, advantages = sampled[stats_mode]
      metrics |= _rollout_metrics(allocs[stats_mode], rollouts, log_p)
      if method != "ce":
        metrics["loss"] = _surrogate_loss(logits, rollouts, advantages, allocs[method],
                                          config.baseline_n)
    if align:
      gram = gradients.gram_matrix(grads)[:len(ALIGNED), :len(ALIGNED)]
      cos = gradients.cosines(gram)
      norms = jnp.sqrt(jnp.diag(gram))
      for i, name in enumerate(ALIGNED[1:], start=1):
        metrics[f"cos/{name}"] = cos[0, i]
        metrics[f"norm_ratio/{name}"] = norms[i] / norms[0]
      metrics["cos/sera_vs_uniform"] = cos[1, 3]
    finite = jnp.all(jnp.isfinite(logits)) & jnp.all(
        jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(ascent)]))
    metrics = {k: jnp.where(finite, v, jnp.nan) for k, v in metrics.items()}
    return TrainState(params, batch_stats, opt_state, state.rng), metrics

  return jax.jit(step_fn, donate_argnums=0)


class ClassificationTask:
  """The `sera_jax.harness.train.Task` of classification as RL."""

  def __init__(self, config: ml_collections.ConfigDict):
    self.mesh = sharding.make_mesh()
    validate_config(config, self.mesh.devices.size)
    self.config = config
    self.dataset = get_dataset(config.dataset, **config.get("dataset_kwargs", {}))
    self.model = create_model(config.model, num_classes=self.dataset.num_classes,
                              input_shape=self.dataset.image_shape,
                              **config.get("model_kwargs", {}))
    self.optimizer = make_optimizer(config)
    self._steps = {align: make_train_step(self.model, self.optimizer, config, align=align,
                                          mesh=self.mesh)
                   for align in (True, False)}
    self._eval_sums = jax.jit(self._eval_sums_fn)

  def _eval_sums_fn(self, state, images, labels, mask):
    """Sums over the real rows of pass@k = 1 - (1 - p)^k, of correct top-1, and of rows."""
    logits, _ = self.model.apply(state.params, state.batch_stats, images, train=False)
    log_p = oracle_log_p(logits, labels)
    pass_at = scaling.coverage(log_p[:, None], jnp.asarray(PASS_AT_K)[None, :])
    correct = jnp.argmax(logits, -1) == labels
    return (jnp.sum(jnp.where(mask[:, None], pass_at, 0.0), 0), jnp.sum(correct & mask),
            jnp.sum(mask))

  def init_state(self, rng: jax.Array) -> TrainState:
    return sharding.replicate(init_train_state(self.model, self.optimizer, rng), self.mesh)

  def _batch(self, step: int):
    local = self.dataset.train_batch(step, self.config.batch_size, self.config.seed,
                                     process_index=jax.process_index(),
                                     process_count=jax.process_count())
    batch = sharding.global_batch(local, self.mesh)
    return batch["image"], batch["label"]

  def train_step(self, state: TrainState, step: int):
    images, labels = self._batch(step)
    align = step % self.config.align_every == 0
    return self._steps[align](state, images, labels, step)

  def evaluate(self, state: TrainState) -> dict[str, float]:
    """pass@k = mean_q 1 - (1 - p_q)^k on the held-out split, and as "validation/pass@k" on the
    validation split when the dataset has one (docs/method.md#classification-as-rl)."""
    metrics = self._evaluate_on(self.dataset, state, "")
    if getattr(self.dataset, "num_validation", 0):
      metrics |= self._evaluate_on(self.dataset.validation_split(), state, "validation/")
    return metrics

  def _evaluate_on(self, dataset, state: TrainState, prefix: str) -> dict[str, float]:
    totals = None
    for local in dataset.eval_batches(self.config.eval_batch_size,
                                      process_index=jax.process_index(),
                                      process_count=jax.process_count()):
      batch = sharding.global_batch(local, self.mesh)
      sums = self._eval_sums(state, batch["image"], batch["label"], batch["mask"])
      totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    pass_at, correct, count = jax.device_get(totals)
    return {f"{prefix}pass@{k}": float(v / count)
            for k, v in zip(PASS_AT_K, pass_at, strict=True)} | {
                f"{prefix or 'eval/'}accuracy": float(correct / count)}

  def write_figures(self, workdir: str, rows: list[dict]) -> None:
    plot_alignment([(self.config.method, rows)], f"{workdir}/alignment.png")

