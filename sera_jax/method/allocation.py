"""Scale-Equalized Rollout Allocation.

See docs/method.md#the-waterline to docs/method.md#weights-and-the-loss.

`allocate` spreads a budget of B = M * N0 rollouts over M prompts so that the
estimator scale kappa(p_q, n_q) = 1 - (1 - p_q)^(n_q - 1) is as equal as
possible across active prompts (the waterline), switches off prompts whose
groups are almost never mixed ("sera"), and returns the prompt weights that
undo the multiplicity of unequal counts.

Everything is jax.numpy: M is the only static shape; p, N0, n_min, n_max and
the threshold are traced, so new values never retrace, and `jax.vmap` maps
over a leading batch of problems.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sera_jax.method import ordering, scaling, validation

MODES = ("uniform", "equalized", "sera")
# docs/method.md#the-waterline, reproduced exactly where the budget is k * n_max.
BISECTION_STEPS = 100
NEWTON_STEPS = 32  # at most this many Newton / bisection steps before the exact float search
NEWTON_ULPS = 4  # Newton has converged once a step moves log tau by at most this many floats
# docs/method.md#the-active-set: useful(k) compares mixed >= threshold - 1e-12.
USEFUL_SLACK = 1e-12


class Allocation(NamedTuple):
  """Rollout counts and prompt weights for one batch of M prompts.

  Attributes:
    counts: int32 [M], rollouts per prompt; sums to M * baseline_n.
    weights: [M], prompt weights w_q of the loss (docs/method.md#weights-and-the-loss), 0 if
      inactive.
    active: bool [M], prompts that receive rollouts.
    continuous: [M], the continuous waterline solution n_q(tau) (docs/method.md#the-waterline), 0 if
      inactive; baseline_n everywhere in "uniform" mode.
    target_fidelity: scalar, the waterline 1 - exp(-tau) (docs/method.md#the-waterline). Allocations
      with one count for all (uniform mode, budget == k * n_min) report the
      lowest kappa, min_q kappa(p_q, n_q).
    fidelity: [M], kappa(p_q, n_q) achieved by the integer counts.
    coverage: [M], pass@n_q = 1 - (1 - p_q)^n_q.
  """
  counts: jax.Array
  weights: jax.Array
  active: jax.Array
  continuous: jax.Array
  target_fidelity: jax.Array
  fidelity: jax.Array
  coverage: jax.Array


def clamp_log_p(log_p: jax.Array) -> jax.Array:
  """The documented probability clamp p in [tiny, 1 - ulp], done on log p.

  tiny is the smallest normal float of the dtype and 1 - ulp the largest
  float below one, so lambda = -log(1 - p) is positive and finite.
  """
  finfo = np.finfo(log_p.dtype)
  lowest = np.log(finfo.tiny).astype(log_p.dtype)
  highest = np.log1p(-finfo.epsneg).astype(log_p.dtype)
  return jnp.clip(log_p, lowest, highest)


def _total_rollouts(continuous: jax.Array, active: jax.Array
                    ) -> tuple[jax.Array, jax.Array]:
  """sum_q n_q over active prompts, as whole parts (exact ints) + fractions.

  Splitting keeps the float32 sum exact in its integer part, so the budget
  comparison does not drift when M * N0 exceeds 2^24.
  """
  whole = jnp.floor(continuous)
  fraction_sum = jnp.sum(jnp.where(active, continuous - whole, 0.0))
  whole_sum = jnp.sum(jnp.where(active, whole, 0.0).astype(jnp.int32))
  return whole_sum, fraction_sum


class _Prompts(NamedTuple):
  """Per-prompt logs computed once and shared by every waterline and test."""
  log_p: jax.Array
  log_q: jax.Array  # log(1 - p)
  lam: jax.Array  # -log(1 - p), the failure rate of docs/method.md#the-waterline
  floor_log_gap: jax.Array  # log(1 - kappa(p, n_min)) = (n_min - 1) log q


def _prompts(log_p: jax.Array, n_min: jax.Array) -> _Prompts:
  log_q = scaling.log1mexp(log_p)
  # p >= tiny implies lambda >= tiny; the floor keeps lambda > 0 where XLA
  # flushes exp(log(tiny)) to zero.
  lam = jnp.maximum(-log_q, np.finfo(log_p.dtype).tiny)
  return _Prompts(log_p, log_q, lam, scaling.log_power(log_q, n_min - 1))


def _waterline(lam, active, budget, n_min, n_max):
  """Solves sum_q clip(1 + tau / lam_q, n_min, n_max) = budget (docs/method.md#the-waterline).

  docs/method.md#the-waterline bisects log(tau) for 100 steps between log(tau_lo) and
  log(tau_hi); that many halvings leave lo and hi adjacent floats, so its
  result is the largest float m in the bracket whose clipped sum at exp(m)
  stays within the budget (the sum is monotone in m). This finds the same
  float with far fewer passes over the prompts. The sum is piecewise linear
  in tau, so Newton's method from the unclipped solution lands on the root's
  segment in a few steps and then on the root to rounding (bisection on
  log tau takes over whenever a step would leave the bracket). A galloping
  search over the integers that order the floats then walks from the last
  point to the boundary, doubling its stride, and bisects the last stride.
  Every point is classified by exactly the test of docs/method.md#the-waterline. At budget = k n_max
  no point is ever over the budget, and docs/method.md#the-waterline's lo creeps towards hi by
  halving; that scalar recurrence is replayed as written. Returns
  (continuous [M], tau); inactive prompts get 0.
  """
  dtype = lam.dtype
  tiny = jnp.asarray(np.finfo(dtype).tiny, dtype)
  n_min_f, n_max_f = n_min.astype(dtype), n_max.astype(dtype)
  inverse_lam = jnp.where(active, 1 / lam, 0.0)
  num_active = jnp.sum(active.astype(jnp.int32))
  lam_min = jnp.min(jnp.where(active, lam, jnp.inf))
  lam_max = jnp.max(jnp.where(active, lam, 0.0))
  log_tau_lo = jnp.log(jnp.where(n_min == 1, tiny, (n_min_f - 1) * lam_min))
  log_tau_hi = jnp.log((n_max_f - 1) * lam_max)
  # Budgets k n_min (the caller's degenerate case) and k n_max need no search.
  searching = (budget > num_active * n_min) & (budget < num_active * n_max)

  def continuous_at(tau):
    return jnp.clip(1 + tau / lam, n_min_f, n_max_f)

  def evaluate(m):
    """(sum - budget, whether the bisection sets hi = m, d sum / d tau) at tau = exp(m).

    The bisection is that of docs/method.md#the-waterline.
    """
    continuous = continuous_at(jnp.exp(m))
    whole, fraction = _total_rollouts(continuous, active)
    remaining = (budget - whole).astype(dtype)
    sloped = (continuous > n_min_f) & (continuous < n_max_f)
    return fraction - remaining, fraction > remaining, jnp.sum(jnp.where(sloped, inverse_lam, 0.0))

  def newton(state):
    lo, hi, m, _, steps = state
    value, over, slope = evaluate(m)
    lo, hi = jnp.where(over, lo, m), jnp.where(over, m, hi)
    proposal = jnp.log(jnp.exp(m) - value / slope)
    key, proposal_key = ordering.ordered_int(m), ordering.ordered_int(proposal)
    converged = (proposal_key >= key - NEWTON_ULPS) & (proposal_key <= key + NEWTON_ULPS)
    inside = (proposal > lo) & (proposal < hi)
    proposal = jnp.where(converged, m, jnp.where(inside, proposal, 0.5 * lo + 0.5 * hi))
    return lo, hi, proposal, converged, steps + 1

  unclipped = jnp.log((budget - num_active).astype(dtype) / jnp.sum(inverse_lam))
  inside = (unclipped > log_tau_lo) & (unclipped < log_tau_hi)
  start = jnp.where(inside, unclipped, 0.5 * log_tau_lo + 0.5 * log_tau_hi)
  lo, hi, last, _, _ = jax.lax.while_loop(
      lambda state: searching & ~state[3] & (state[4] < NEWTON_STEPS), newton,
      (log_tau_lo, log_tau_hi, start, jnp.zeros((), bool), jnp.zeros((), jnp.int32)))
  upward = last == lo  # walk away from the side of the last point; from hi if none was

  def gallop(bracket):
    lo, hi, stride = bracket
    half = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
    ahead = jnp.where(upward, stride < half - lo, stride < hi - half)
    mid = jnp.where(ahead, jnp.where(upward, lo + stride, hi - stride), half)
    _, over, _ = evaluate(ordering.from_ordered_int(mid, dtype))
    grow = ahead & (stride <= jnp.iinfo(stride.dtype).max // 2)  # never overflows
    return jnp.where(over, lo, mid), jnp.where(over, mid, hi), jnp.where(grow, 2 * stride, stride)

  lo, hi = ordering.ordered_int(lo), ordering.ordered_int(hi)
  lo, _, _ = jax.lax.while_loop(lambda bracket: searching & (bracket[1] > bracket[0] + 1),
                                gallop, (lo, hi, jnp.ones_like(lo)))

  def halve_towards_hi():
    return jax.lax.fori_loop(0, BISECTION_STEPS, lambda _, m: 0.5 * (m + log_tau_hi), log_tau_lo)

  saturated = budget == num_active * n_max
  tau = jnp.exp(jax.lax.cond(saturated, halve_towards_hi,
                             lambda: ordering.from_ordered_int(lo, dtype)))
  return jnp.where(active, continuous_at(tau), 0.0), tau


def _floors(active, continuous, n_min, n_max):
  """The counts before rounding: clip(floor(n_q(tau)), n_min, n_max), 0 if inactive.

  See docs/method.md#integer-rounding.
  """
  return jnp.where(active, jnp.clip(jnp.floor(continuous).astype(jnp.int32), n_min, n_max), 0)


def _marginal_keys(prompts, candidate, floors, log_gap):
  """The marginal squared error of one more rollout, as sortable ints (inf off candidates).

  The error e_q of docs/method.md#integer-rounding, compared in the form that page gives:
  from x = log r = (n - 1) log q - log(1 - target) (`log_gap` is the latter log),
  e_q / (1 - target)^2 = g = -r p S with S = expm1(x + log q) + expm1(x), which neither
  rounds kappa to 1 for easy prompts nor cancels for hard ones. The key is
  sign(g) / (ceiling - log|g|), increasing in g and never underflowing: |g| <= 1 / q^2
  and q >= epsneg (the clamp of p) keep log|g| below the ceiling 1 - 2 log(epsneg).
  """
  x = scaling.log_power(prompts.log_q, jnp.maximum(floors - 1, 0)) - log_gap
  s = jnp.expm1(x + prompts.log_q) + jnp.expm1(x)
  ceiling = 1.0 - 2.0 * np.log(np.finfo(x.dtype).epsneg)
  key = -jnp.sign(s) / (ceiling - (x + prompts.log_p + jnp.log(jnp.abs(s))))
  return ordering.ordered_int(jnp.where(candidate, key, jnp.inf))


def _round_to_budget(prompts, active, continuous, log_gap, budget, n_min, n_max):
  """Integer counts summing to `budget` (docs/method.md#integer-rounding).

  Floors the continuous solution, then gives one more rollout to the R
  candidates (n_q < n_max) whose squared distance to the waterline improves
  the most, ties to the smaller prompt index.
  """
  floors = _floors(active, continuous, n_min, n_max)
  keys = _marginal_keys(prompts, active & (floors < n_max), floors, log_gap)
  chosen = ordering.first_smallest(keys, jax.lax.sort(keys), budget - jnp.sum(floors))
  return floors + chosen.astype(jnp.int32)


def _continuous_solution(prompts, active, budget, n_min, n_max):
  """The waterline among `active` prompts: (continuous [M], log(1 - target_fidelity)).

  See docs/method.md#the-waterline.
  """
  num_active = jnp.sum(active.astype(jnp.int32))
  at_floor = budget == num_active * n_min
  continuous, tau = _waterline(prompts.lam, active, budget, n_min, n_max)
  # At the budget k n_min the target is the lowest kappa(p, n_min), the highest gap.
  floor_log_gap = jnp.max(jnp.where(active, prompts.floor_log_gap, -jnp.inf))
  log_gap = jnp.where(at_floor, floor_log_gap, -tau)
  continuous = jnp.where(at_floor, jnp.where(active, n_min.astype(log_gap.dtype), 0.0),
                         continuous)
  return continuous, log_gap


def _equalized(prompts, active, budget, n_min, n_max):
  """The "equalized" allocation of `budget` among `active` prompts.

  See docs/method.md#the-waterline and docs/method.md#integer-rounding.

  Returns (counts, continuous, target_fidelity).
  """
  continuous, log_gap = _continuous_solution(prompts, active, budget, n_min, n_max)
  counts = _round_to_budget(prompts, active, continuous, log_gap, budget, n_min, n_max)
  return counts, continuous, -jnp.expm1(log_gap)


def _select_active(prompts, budget, n_min, n_max, threshold, force_active):
  """The active set of mode "sera": the largest useful prefix of the ranking.

  See docs/method.md#the-active-set.

  Prompts are ranked by mixed(p_q, n_max), descending (ties by index); the
  first k are active. The ranking sorts log(1 - mixed) ascending, the same
  order without the float rounding of mixed to 1 that would tie prompts. k is
  found by binary search over [required, eligible] for the largest k whose
  allocation leaves every active prompt mixed with probability >= threshold.
  Force-activated prompts rank first, count as eligible and are exempt from
  the usefulness test.
  """
  log_p, log_q = prompts.log_p, prompts.log_q
  score = scaling.mixed_from_logs(log_p, log_q, n_max)
  unmixed = scaling.log_unmixed_from_logs(log_p, log_q, n_max)
  keys = ordering.ordered_int(jnp.where(force_active, -jnp.inf, unmixed))
  sorted_keys = jax.lax.sort(keys)  # one sort serves every prefix
  eligible = jnp.sum((force_active | (score >= threshold)).astype(jnp.int32))
  required = jnp.maximum((budget + n_max - 1) // n_max, jnp.sum(force_active.astype(jnp.int32)))

  def useful(k):
    """The usefulness test on the rounded counts, which are floor(n_q(tau)) or one more.

    The test is that of docs/method.md#the-active-set.

    mixed is increasing in n, so the test fails outright when a prompt fails
    at its floor plus one, and otherwise holds when every prompt that fails
    at its floor is among the R that docs/method.md#integer-rounding rounds up.
    """
    active = ordering.first_smallest(keys, sorted_keys, k)
    checked = active & ~force_active
    continuous, log_gap = _continuous_solution(prompts, active, budget, n_min, n_max)
    floors = _floors(active, continuous, n_min, n_max)

    def failing(counts):
      return checked & (scaling.mixed_from_logs(log_p, log_q, counts) < threshold - USEFUL_SLACK)

    failing_floors = failing(floors)
    ceilings_pass = ~jnp.any(failing(jnp.minimum(floors + 1, n_max)))

    def rounded_up():
      marginal_keys = _marginal_keys(prompts, active & (floors < n_max), floors, log_gap)
      return ordering.all_among_first(marginal_keys, failing_floors, budget - jnp.sum(floors))

    return ceilings_pass & jax.lax.cond(jnp.any(failing_floors), rounded_up, lambda: True)

  def search(state):
    lo, hi, best = state
    mid = (lo + hi) // 2
    ok = useful(mid)
    return jnp.where(ok, mid + 1, lo), jnp.where(ok, hi, mid - 1), jnp.where(ok, mid, best)

  _, _, best = jax.lax.while_loop(
      lambda state: state[0] <= state[1], search, (required, eligible, required))
  return ordering.first_smallest(keys, sorted_keys, best)


def _allocate(log_p, baseline_n, n_min, n_max, threshold, force_active, *, mode,
              normalize_by_rollout_count, normalize_by_rho):
  log_p = clamp_log_p(log_p)
  num_prompts = log_p.shape[0]
  dtype = log_p.dtype
  budget = num_prompts * baseline_n
  prompts = _prompts(log_p, n_min)
  if mode == "uniform":
    active = jnp.ones(num_prompts, bool)
    counts = jnp.full(num_prompts, baseline_n, jnp.int32)
    continuous = counts.astype(dtype)
    target = jnp.min(scaling.fidelity_from_logs(prompts.log_q, counts))
  else:
    if mode == "sera":
      active = _select_active(prompts, budget, n_min, n_max, threshold, force_active)
    else:
      active = jnp.ones(num_prompts, bool)
    counts, continuous, target = _equalized(prompts, active, budget, n_min, n_max)

  has_rollouts = active & (counts > 0)
  safe_counts = jnp.maximum(counts, 1).astype(dtype)
  unit = baseline_n.astype(dtype) / safe_counts if normalize_by_rollout_count else 1.0
  weights = jnp.where(has_rollouts, unit, 0.0).astype(dtype)
  coverage = scaling.coverage_from_logs(prompts.log_q, counts)
  if normalize_by_rho and mode != "uniform":
    rho = jnp.sum(jnp.where(active, coverage, 0.0)) / jnp.sum(active)
    weights = weights / rho
  return Allocation(
      counts=counts.astype(jnp.int32),
      weights=weights,
      active=active,
      continuous=continuous,
      target_fidelity=target,
      fidelity=scaling.fidelity_from_logs(prompts.log_q, counts),
      coverage=coverage,
  )


_allocate_jit = jax.jit(
    _allocate, static_argnames=("mode", "normalize_by_rollout_count", "normalize_by_rho"))


def allocate(
    log_p: jax.Array,
    *,
    baseline_n: int,
    n_min: int,
    n_max: int,
    mode: str = "sera",
    threshold: float = 0.05,
    normalize_by_rollout_count: bool = True,
    normalize_by_rho: bool = False,
    force_active: jax.Array | None = None,
) -> Allocation:
  """Allocates B = M * baseline_n rollouts over M prompts.

  See docs/method.md#the-waterline to docs/method.md#weights-and-the-loss.

  Modes:
    * "uniform": n_q = baseline_n for every prompt (the MaxRL baseline).
    * "equalized": every prompt active; n_q = clip(1 + tau / lam_q, n_min,
      n_max) with tau solving sum_q n_q = B (docs/method.md#the-waterline), rounded to integers by
      the marginal squared error to the waterline (docs/method.md#integer-rounding).
    * "sera": the equalized allocation over the largest prefix of prompts,
      ranked by mixed(p_q, n_max), whose groups stay mixed with probability
      >= threshold (docs/method.md#the-active-set); the rest get 0.
  Weights (docs/method.md#weights-and-the-loss): w_q = baseline_n / n_q on active prompts (1 when
  `normalize_by_rollout_count` is False), divided by rho = mean active
  coverage(p_q, n_q) when `normalize_by_rho` (ignored in "uniform" mode,
  whose weights are the plain MaxRL ones by definition).

  Args:
    log_p: [M] log success probabilities, finite and <= 0. p is clamped to
      [tiny, 1 - ulp] of the dtype.
    baseline_n: N0, the mean rollouts per prompt; the budget is M * N0.
    n_min: the fewest rollouts of an active prompt (>= 1; 2 to learn).
    n_max: the most rollouts of one prompt.
    mode: "uniform", "equalized" or "sera".
    threshold: minimum mixed-group probability of an active prompt, in [0, 1].
    normalize_by_rollout_count: use w_q = N0 / n_q (True) or 1 (False).
    normalize_by_rho: divide the weights by the mean active coverage.
    force_active: optional bool [M]; these prompts are always active in
      "sera" mode (ranked first and exempt from the threshold).

  Returns:
    An `Allocation`.

  Raises:
    ValueError: on invalid log-probabilities, infeasible bounds
      (n_min < 1, n_min > baseline_n, baseline_n > n_max), a threshold
      outside [0, 1], an unknown mode, no prompt, or a force_active shape mismatch.
    TypeError: a threshold that is no number, or a normalize flag that is no bool.
  """
  log_p = validation.log_probabilities("log_p", log_p)
  validation.rank("log_p", log_p, 1)
  if not log_p.shape[0]:
    raise ValueError("log_p must hold at least one prompt; got shape (0,).")
  validation.choice("mode", mode, MODES)
  validation.budget_bounds(baseline_n, n_min, n_max)
  if validation.is_concrete(threshold):
    threshold = validation.in_unit_interval("threshold", threshold)
  if force_active is None:
    force_active = jnp.zeros(log_p.shape, bool)
  else:
    force_active = validation.mask("force_active", force_active)
    validation.same_shape(("log_p", "force_active"), log_p, force_active)
  as_int = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731
  return _allocate_jit(
      log_p, as_int(baseline_n), as_int(n_min), as_int(n_max),
      jnp.asarray(threshold, log_p.dtype), force_active,
      mode=mode,
      normalize_by_rollout_count=validation.boolean("normalize_by_rollout_count",
                                                    normalize_by_rollout_count),
      normalize_by_rho=validation.boolean("normalize_by_rho", normalize_by_rho))


def max_count(mode: str, *, baseline_n: int, n_max: int) -> int:
  """The most rollouts `mode` gives one prompt: the static width of its rollout arrays."""
  return baseline_n if mode == "uniform" else n_max


def rollout_metrics(alloc: Allocation, successes: jax.Array, log_p: jax.Array, *,
                    estimated: bool = False) -> dict[str, jax.Array]:
  """Per-step statistics of an allocation and of its groups' success counts [M].

  Args:
    alloc: the step's allocation.
    successes: [M] successes of each prompt's group.
    log_p: [M] the log p the allocation used.
    estimated: log_p is an estimate (historical, pilot), not the true p: its
      statistics are then named p_estimate/... and kappa_estimate/...
  """
  active = alloc.active
  num_active = jnp.maximum(jnp.sum(active), 1)
  counts = alloc.counts.astype(jnp.float32)
  mixed = (successes > 0) & (successes < alloc.counts)
  fidelity_active = jnp.where(active, alloc.fidelity, jnp.nan)
  kappa = "kappa_estimate" if estimated else "kappa"
  return {
      "rollouts/min": jnp.min(counts), "rollouts/max": jnp.max(counts),
      "rollouts/std": jnp.std(counts), "active_fraction": jnp.mean(active),
      "useful_group_fraction": jnp.sum(mixed & active) / num_active,
      "all_zero_group_fraction": jnp.sum((successes == 0) & active) / num_active,
      ("p_estimate/mean" if estimated else "p/mean"): jnp.mean(jnp.exp(log_p)),
      f"{kappa}/target": alloc.target_fidelity,
      f"{kappa}/spread": jnp.nanmax(fidelity_active) - jnp.nanmin(fidelity_active),
  }
