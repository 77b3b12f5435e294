"""Gradient estimators of classification as RL and their alignment with the exact gradient.

* Methods: how a batch becomes a gradient estimate. A `Method` holds an
  allocation function (key, logits, labels, extras) -> `Allocation` plus the
  static normalisation and width of its rollouts; `oracle_method`,
  `estimate_method` and `pilot_method` build the allocations the figures
  compare (docs/method.md#estimating-p: oracle, historical, pilot estimates of p).
* `make_evaluator`: for a fixed batch and any set of methods, ONE jitted call
  draws every seed's rollouts (`jax.vmap` over keys), stacks the exact,
  realized and expected logit cotangents (docs/method.md#classification-as-rl), pushes them
  through one `jax.vjp` and returns each estimate's cosine with the exact gradient from their
  Gram matrix (`gradients.gram_matrix` / `gradients.cosines`).
"""

from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sera_jax.method import estimators, registry, success
from sera_jax.method.allocation import Allocation
from sera_jax.settings.classification import allocations, gradients
from sera_jax.settings.classification.task import ClassificationTask

# (key, logits, labels, extras) -> Allocation; extras: per-batch inputs given to the evaluator.
EXPECTATION_DRAWS = 512  # Monte Carlo draws of an outcome-dependent method's expected gradient
EXPECTATION_SALT = 0x5E4A  # folded into the first seed's key for those draws
AllocateFn = Callable[[jax.Array, jax.Array, jax.Array, Mapping[str, jax.Array]], Allocation]


class Method(NamedTuple):
  """A gradient estimator of the loss: an allocation and how it is scored.

  The loss is that of docs/method.md#weights-and-the-loss.

  Attributes:
    allocate: (key, logits, labels, extras) -> `Allocation` of the (second-stage)
      rollouts; `extras` are the per-batch arrays passed to the evaluator.
    baseline_n: the N0 normalising the loss (docs/method.md#weights-and-the-loss) of those rollouts.
    max_rollouts: static padded width of the rollouts (>= every count).
    estimator: a registered estimator's name, or an `estimators.Estimator` with its
      parameters.
    random_allocation: True when the allocation depends on the key (a pilot);
      then every seed has its own allocation and its own expected gradient.
    outcome_dependent: True when the allocation reads the outcomes of the very
      rollouts the gradient uses (adaptive sampling): it is called with each
      seed's sampling key, and its expected gradient, which has no closed form,
      is the mean realized gradient over `EXPECTATION_DRAWS` keys.
  """
  allocate: AllocateFn
  baseline_n: int
  max_rollouts: int
  estimator: str | estimators.Estimator = "maxrl"
  random_allocation: bool = False
  outcome_dependent: bool = False


def _method(log_p_fn, *, baseline_n, n_min, n_max, mode, estimator, **options) -> Method:
  """A Method allocating with `mode` (`allocations.MODES`) on log_p_fn's log p (None: exact).

  `options`: the other fields of `registry.AllocationConfig` (threshold, round_size, ...).
  """
  config = registry.AllocationConfig(mode=mode, baseline_n=baseline_n, n_min=n_min,
                                     n_max=n_max, estimator=estimator, **options)

  def allocate(key, logits, labels, extras):
    log_p = None if log_p_fn is None else log_p_fn(key, logits, labels, extras)
    return registry.allocate_with(config, allocations.inputs(config, logits, labels, key,
                                                             log_p=log_p))
  return Method(allocate, baseline_n, config.max_count, config.estimator_spec,
                outcome_dependent=registry.ALLOCATORS[mode].outcome_dependent)


def oracle_method(*, baseline_n: int, n_min: int, n_max: int, mode: str = "sera",
                  estimator: str = "maxrl", **options) -> Method:
  """Allocation on the exact p (docs/method.md#estimating-p oracle), in any of `allocations.MODES`.

  `options`: threshold, normalize_by_* (SERA's modes) or round_size (adaptive).
  """
  return _method(None, baseline_n=baseline_n, n_min=n_min, n_max=n_max, mode=mode,
                 estimator=estimator, **options)


def estimate_method(extra: str, *, baseline_n: int, n_min: int, n_max: int,
                    mode: str = "sera", estimator: str = "maxrl", **options) -> Method:
  """Allocation on an estimate of log p given per batch as `extras[extra]` (e.g. historical)."""
  given = lambda key, logits, labels, extras: extras[extra]  # noqa: E731
  return _method(given, baseline_n=baseline_n, n_min=n_min, n_max=n_max, mode=mode,
                 estimator=estimator, **options)


def pilot_method(num_pilot: int, *, baseline_n: int, n_min: int, n_max: int,
                 mode: str = "sera", estimator: str = "maxrl", **options) -> Method:
  """Two-stage SERA: num_pilot rollouts per prompt estimate p, the rest is allocated.

  This is the pilot of docs/method.md#estimating-p.

  The pilot spends M * num_pilot of the budget M * baseline_n only on the
  estimate; the gradient uses the independent second stage, allocated with
  `success.pilot_budget_split(baseline_n, num_pilot)` rollouts per prompt on
  average and normalised by that baseline.
  """
  rest = success.pilot_budget_split(baseline_n, num_pilot)

  def pilot_log_p(key, logits, labels, extras):
    counts = jnp.full(labels.shape, num_pilot, jnp.int32)
    pilot = gradients.sample_rollouts(key, logits, labels, counts, max_rollouts=num_pilot)
    return success.pilot_log_p(jnp.sum(pilot.rewards, axis=1), num_pilot)

  return _method(pilot_log_p, baseline_n=rest, n_min=n_min, n_max=n_max, mode=mode,
                 estimator=estimator, **options)._replace(random_allocation=True)


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


def _seed_allocations(method: Method, allocation_keys, sample_keys, logits, labels, extras
                      ) -> Allocation:
  """The [S, M] allocation of every seed (one allocation, broadcast, unless it is random)."""
  if method.outcome_dependent:
    return jax.vmap(lambda key: method.allocate(key, logits, labels, extras))(sample_keys)
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
  padded to their widest rollouts: padding is masked out and slot j of prompt
  q draws from (key, q, j) alone (`gradients.sample_rollouts`), so the result
  does not depend on the width or on which methods share the call
  (tests/test_alignment.py), and compilation is paid once per estimator.
  """
  allocation_keys, sample_keys = jax.vmap(jax.random.split, out_axes=1)(keys)
  allocs = {name: _seed_allocations(method, allocation_keys, sample_keys, logits, labels,
                                    extras)
            for name, method in methods.items()}
  # Monte Carlo keys of the outcome-dependent methods' expectations, apart from the seeds'.
  draw_keys = jax.random.split(jax.random.fold_in(keys[0], EXPECTATION_SALT), EXPECTATION_DRAWS)
  realized, expected = {}, {}
  for estimator in sorted({method.estimator for method in methods.values()}, key=str):
    group = [name for name, method in methods.items() if method.estimator == estimator]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *[allocs[name] for name in group])
    baselines = jnp.asarray([methods[name].baseline_n for name in group], logits.dtype)
    width = max(methods[name].max_rollouts for name in group)

    def realize(alloc, baseline_n, key, estimator=estimator, width=width):
      cotangent, _, _ = gradients.sample_and_score(
          key, logits, labels, alloc, baseline_n=baseline_n, estimator=estimator,
          max_rollouts=width)
      return cotangent

    def expect(alloc, baseline_n, estimator=estimator, width=width):
      return gradients.expected_logit_grad(logits, labels, alloc, baseline_n=baseline_n,
                                                estimator=estimator, max_rollouts=width)

    over_seeds = jax.vmap(realize, in_axes=(0, None, 0))
    realized_rows = jax.vmap(over_seeds, in_axes=(0, 0, None))(stacked, baselines, sample_keys)
    expected_rows = jax.vmap(jax.vmap(expect, in_axes=(0, None)))(stacked, baselines)
    for index, name in enumerate(group):
      realized[name] = realized_rows[index]
      method = methods[name]
      if method.outcome_dependent:
        def draw(key, method=method, realize=realize):
          alloc = method.allocate(key, logits, labels, extras)
          return realize(alloc, jnp.asarray(method.baseline_n, logits.dtype), key)
        expected[name] = jnp.mean(jax.lax.map(draw, draw_keys, batch_size=64), axis=0)[None]
      else:
        expected[name] = (expected_rows[index] if method.random_allocation
                          else expected_rows[index, :1])
  return realized, expected, allocs


def make_evaluator(task: ClassificationTask, methods: Mapping[str, Method]):
  """One jitted call: (state, images, labels, keys [S], extras={}) -> {name: `Alignment`}.

  All seeds and all methods share one forward pass and one `jax.vjp`: the
  exact cotangent, then per method S realized and S (or 1) expected cotangents, are stacked and
  pushed through `jax.vmap(vjp_fn)` (docs/method.md#classification-as-rl).
  """
  names = list(methods)

  def evaluate(state, images, labels, keys, extras=None):
    extras = {} if extras is None else extras
    forward = lambda p: task.model.apply(p, state.batch_stats, images, train=True)  # noqa: E731
    logits, vjp_fn, _ = jax.vjp(forward, state.params, has_aux=True)
    realized, expected, allocs = _cotangents(methods, keys, logits, labels, extras)
    rows = [gradients.exact_logit_grad(logits, labels)[None]]
    for name in names:
      rows += [realized[name], expected[name]]
    (grads,) = jax.vmap(vjp_fn)(jnp.concatenate(rows))
    gram = gradients.gram_matrix(grads)
    with_exact = gradients.cosines(gram)[0]
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
