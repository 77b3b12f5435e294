"""Baseline rollout allocators beside SERA: Knapsack-RL, GVM-RAFT and adaptive sampling.

Each spends the same budget B = M * N0 rollouts over M prompts as
`sera_jax.method.allocation.allocate` (N0 = `baseline_n`), with
n_min <= n_q <= n_max and sum_q n_q = B exactly, and returns the same
`Allocation`: every prompt is active (n_q >= n_min >= 1), its weight is the
multiplicity correction w_q = N0 / n_q of docs/method.md#weights-and-the-loss, and fidelity /
coverage / target_fidelity are kappa(p_q, n_q), pass@n_q and min_q kappa(p_q, n_q) on the
clamped p, as `allocate` reports them.

* `knapsack`: Knapsack-RL (Li et al. 2025, arXiv 2509.25849; github
  liziniu/KnapsackRL, `sampling_budget_by_knapsack`), solved exactly.
* `gvm`: GVM-RAFT (Yao et al. 2025, arXiv 2505.02391; github RLHFlow/GVM,
  em/stage_2_calc_sample_size.py `calc_sample_ratio`), clipped and rounded.
* `adaptive`: successive elimination in rounds, in the spirit of Reinforce-Ada
  (Xiong et al. 2025; github RLHFlow/Reinforce-Ada, Algorithm 1), on given
  rollout outcomes.

All three are pure and jittable with static shapes: M, baseline_n, n_min,
n_max (and round_size) are static Python ints; log p (and the gradient norms,
alpha, beta, the outcomes) are traced, so new values never retrace, and `jax.vmap`
maps over a leading batch of problems. Unlike `allocate`, log p = -inf (p = 0)
is accepted: Knapsack-RL and GVM define what a prompt never solved gets.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

from sera_jax.method import ordering, scaling, validation
from sera_jax.method.allocation import Allocation, clamp_log_p

MODES = ("knapsack", "gvm", "adaptive")
# GVM-RAFT's defaults: `ScriptArguments.alpha` / `.beta` of em/stage_2_calc_sample_size.py
# and alpha=0.001, beta=2.0 in runs/scripts/run_em.sh (github RLHFlow/GVM).
GVM_ALPHA = 1e-3
GVM_BETA = 2.0
GVM_BISECTION_STEPS = 100  # halvings of the log-scale bracket before the exact linear solve


# ---------------------------------------------------------------------------------------------
# Shared pieces.


def _log_probabilities(log_p) -> jax.Array:
  """log p as a float array of rank 1, as `validation.log_probabilities` but -inf (p = 0) passes."""
  arr = jnp.asarray(log_p)
  if validation.is_concrete(arr):
    values = np.asarray(arr)
    if jnp.issubdtype(values.dtype, jnp.floating):
      values = np.where(np.isneginf(values), -1, values).astype(values.dtype)
    arr = arr.astype(validation.log_probabilities("log_p", values).dtype)  # raises on bad values
  else:
    arr = validation.log_probabilities("log_p", arr)
  validation.rank("log_p", arr, 1)
  return arr


def _check(baseline_n, n_min, n_max):
  """Bounds of `allocate` (1 <= n_min <= baseline_n <= n_max), as static Python ints.

  `validation.budget_bounds` skips traced values; here they are static, so a
  tracer is rejected (TypeError) rather than skipped.
  """
  for name, value in (("baseline_n", baseline_n), ("n_min", n_min), ("n_max", n_max)):
    validation.integer(name, value, minimum=1)
  validation.budget_bounds(baseline_n, n_min, n_max)


def _finish(log_p, counts, continuous, baseline_n) -> Allocation:
  """The `Allocation` of integer counts (every prompt with n_q >= 1 active).

  See docs/method.md#weights-and-the-loss.
  """
  dtype = log_p.dtype
  log_q = scaling.log1mexp(clamp_log_p(log_p))
  active = counts > 0
  weights = jnp.where(active, baseline_n / jnp.maximum(counts, 1).astype(dtype), 0.0)
  fidelity = scaling.fidelity_from_logs(log_q, counts)
  return Allocation(
      counts=counts.astype(jnp.int32),
      weights=weights.astype(dtype),
      active=active,
      continuous=continuous.astype(dtype),
      target_fidelity=jnp.min(jnp.where(active, fidelity, jnp.inf)),
      fidelity=fidelity,
      coverage=scaling.coverage_from_logs(log_q, counts),
  )


def _smallest_first(keys: jax.Array, count) -> jax.Array:
  """Mask of the `count` smallest float keys, ties to the smaller index (a stable-sort prefix)."""
  int_keys = ordering.ordered_int(keys)
  return ordering.first_smallest(int_keys, jax.lax.sort(int_keys), jnp.asarray(count, jnp.int32))


# ---------------------------------------------------------------------------------------------
# Knapsack-RL.


def knapsack_value(log_p: jax.Array, n: jax.Array) -> jax.Array:
  """v(n, p) = (1 - p^n - (1 - p)^n) * p * (1 - p)^2, Knapsack-RL's value of n rollouts.

  mixed(p, n) (the group has a success and a failure) times Knapsack-RL's
  gradient factor p (1 - p)^2 (`solve_by_dp` in liziniu/KnapsackRL
  verl/trainer/ppo/exploration_utils.py); 0 at n <= 1 and at p in {0, 1}.
  """
  log_p, n = jnp.broadcast_arrays(jnp.asarray(log_p), jnp.asarray(n, jnp.asarray(log_p).dtype))
  log_q = scaling.log1mexp(log_p)
  return scaling.mixed_from_logs(log_p, log_q, n) * jnp.exp(log_p + 2 * log_q)


def _log_marginal_gain(log_p: jax.Array, n: jax.Array) -> jax.Array:
  """log(v(n + 1, p) - v(n, p)) for n >= 1, in closed form.

  v(n + 1) - v(n) = [p^n (1 - p) + (1 - p)^n p] p (1 - p)^2
                  = p^2 (1 - p)^3 (p^(n-1) + (1 - p)^(n-1));
  -inf (gain 0) at p in {0, 1}.
  """
  log_q = scaling.log1mexp(log_p)
  power = lambda log_x: scaling.log_power(log_x, n - 1)  # noqa: E731  (0 * log 0 = 0)
  return 2 * log_p + 3 * log_q + jnp.logaddexp(power(log_p), power(log_q))


@functools.partial(jax.jit, static_argnames=("baseline_n", "n_min", "n_max"))
def _knapsack(log_p, *, baseline_n, n_min, n_max):
  chex.assert_rank(log_p, 1)
  num_prompts = log_p.shape[0]
  extra = num_prompts * (baseline_n - n_min)  # rollouts beyond n_min each, static
  width = n_max - n_min
  if extra == 0:
    counts = jnp.full(num_prompts, n_min, jnp.int32)
  else:
    n = jnp.arange(n_min, n_max, dtype=log_p.dtype)
    log_gain = _log_marginal_gain(log_p[None, :], n[:, None])  # [width, M]: step n -> n + 1
    # Non-increasing in n in exact arithmetic; the running min removes rounding wiggles so
    # that every prompt's chosen steps are a prefix n_min -> n_min + k.
    log_gain = jax.lax.cummin(log_gain, axis=0)
    chosen = _smallest_first(-log_gain.reshape(-1), extra)  # order (gain desc, n, prompt)
    counts = n_min + jnp.sum(chosen.reshape(width, num_prompts), axis=0, dtype=jnp.int32)
  chex.assert_shape(counts, (num_prompts,))
  return _finish(log_p, counts, counts.astype(log_p.dtype), baseline_n)


def knapsack(log_p: jax.Array, *, baseline_n: int, n_min: int, n_max: int) -> Allocation:
  """Knapsack-RL's allocation, solved exactly (arXiv 2509.25849, §3; liziniu/KnapsackRL).

  Maximises sum_q v(n_q, p_q) subject to sum_q n_q = B = M * baseline_n and
  n_min <= n_q <= n_max, where (`knapsack_value`)

      v(n, p) = (1 - p^n - (1 - p)^n) * p * (1 - p)^2,

  the probability that the group is mixed times the gradient factor of
  `sampling_budget_by_knapsack` / `solve_by_dp` in
  verl/trainer/ppo/exploration_utils.py. That code solves it by a DP over
  prompts and budget; here it is solved exactly by a greedy: the marginal gain

      v(n + 1, p) - v(n, p) = p^2 (1 - p)^3 (p^(n-1) + (1 - p)^(n-1))

  is non-increasing in n for every p in [0, 1] and n >= 1 (both powers are;
  also checked numerically on a grid of p in [0, 1] and n < 600, where the
  largest increase was 6e-17, rounding), so v(., p) is concave on n >= 1
  (not from n = 0: v(0) = v(1) = 0 < v(2); n_min >= 1 is required) and the
  separable concave resource-allocation problem is solved exactly by giving
  the B - M n_min rollouts above the floors to the largest marginal gains.
  Those are taken as the top of all M (n_max - n_min) gains, ties in the
  order (n, prompt index): for equal p the extra rollouts go round-robin
  by index.

  Prompts with p = 0 or p = 1 (value identically 0; the reference code gives
  them fixed `negative_n` / `positive_n`, by default its min_n) get n_min,
  unless every other prompt is at n_max and the budget must still be spent:
  then the rest goes to them round-robin by index (the reference spreads its
  spare budget evenly over the zero-success prompts).

  Args:
    log_p: [M] log success probabilities, <= 0; -inf (p = 0) allowed. The
      value uses p unclamped; fidelity and coverage use `clamp_log_p`.
    baseline_n: N0 (static); the budget is M * N0.
    n_min: the fewest rollouts of a prompt (static, >= 1).
    n_max: the most rollouts of a prompt (static).

  Returns:
    An `Allocation`; `continuous` holds the counts as floats.

  Raises:
    ValueError: invalid log_p, or bounds outside 1 <= n_min <= baseline_n <= n_max.
  """
  log_p = _log_probabilities(log_p)
  _check(baseline_n, n_min, n_max)
  return _knapsack(log_p, baseline_n=baseline_n, n_min=n_min, n_max=n_max)


# ---------------------------------------------------------------------------------------------
# GVM-RAFT.


def gvm_log_score(log_p: jax.Array, grad_norm: jax.Array, alpha=GVM_ALPHA,
                  beta=GVM_BETA) -> jax.Array:
  """log of GVM's unnormalised sample size G / sqrt(p + alpha / p^(beta - 1)).

  github RLHFlow/GVM, em/stage_2_calc_sample_size.py `calc_sample_ratio`
  (arXiv 2505.02391, the sample size minimising the gradient variance). -inf
  where G = 0 or p = 0, which that code sends to sample size 0.
  """
  log_p = jnp.asarray(log_p)
  log_alpha = jnp.log(jnp.asarray(alpha, log_p.dtype))
  log_penalty = jnp.logaddexp(log_p, log_alpha + scaling.log_power(log_p, 1 - beta))
  score = jnp.log(grad_norm.astype(log_p.dtype)) - 0.5 * log_penalty
  return jnp.where((grad_norm > 0) & jnp.isfinite(log_p), score, -jnp.inf)


def _gvm_continuous(log_score, budget, n_min, n_max):
  """n_q = clip(c * s_q, n_min, n_max) with sum_q n_q = budget (water-filling on the scale c).

  Prompts with score 0 hold n_min while the others can absorb the budget;
  the rest of it, if any, is split evenly among them. The scale is found by
  bisection on log c, then solved exactly on the bracket's clipping pattern:
  c = (budget - n_min #low - n_max #high) / sum_free s_q.
  """
  num_prompts = log_score.shape[0]
  dtype = log_score.dtype
  lo, hi = float(n_min), float(n_max)
  positive = jnp.isfinite(log_score)
  num_positive = jnp.sum(positive, dtype=jnp.int32)
  num_zero = num_prompts - num_positive
  spare = (budget - num_zero * n_min).astype(dtype)  # the positive prompts' budget
  top = jnp.max(jnp.where(positive, log_score, -jnp.inf))
  x = jnp.where(positive, log_score - jnp.where(positive.any(), top, 0.0), -jnp.inf)

  def clipped(log_c):
    return jnp.where(positive, jnp.clip(jnp.exp(log_c + x), lo, hi), 0.0)

  def halve(_, bracket):
    a, b = bracket
    mid = 0.5 * (a + b)
    over = jnp.sum(clipped(mid)) > spare
    return jnp.where(over, a, mid), jnp.where(over, mid, b)

  log_lo = jnp.asarray(np.log(lo), dtype)  # c s_max = n_min: all at the floor
  log_hi = np.log(hi) - jnp.min(jnp.where(positive, x, jnp.inf))  # c s_min = n_max
  a, b = jax.lax.fori_loop(0, GVM_BISECTION_STEPS, halve, (log_lo, log_hi))
  mid = 0.5 * (a + b)
  scaled = jnp.exp(mid + x)
  low, high = positive & (scaled <= lo), positive & (scaled >= hi)
  free = positive & ~low & ~high
  free_sum = jnp.sum(jnp.where(free, jnp.exp(x), 0.0))
  rest = spare - lo * jnp.sum(low) - hi * jnp.sum(high)
  log_c = jnp.where(free_sum > 0, jnp.log(jnp.maximum(rest, 0.0) / free_sum), mid)
  solved = clipped(log_c)
  saturated = spare >= hi * num_positive  # every positive prompt at n_max (or none positive)
  zero_level = lo + (budget - hi * num_positive - lo * num_zero) / jnp.maximum(num_zero, 1)
  return jnp.where(positive, jnp.where(saturated, hi, solved), jnp.where(saturated, zero_level, lo))


def _largest_remainder(continuous, budget, n_min, n_max):
  """Floors, then +1 to the budget - sum(floors) prompts below n_max with the largest fractions.

  Ties go to the smaller prompt index.
  """
  floors = jnp.clip(jnp.floor(continuous).astype(jnp.int32), n_min, n_max)
  remainder = budget - jnp.sum(floors)
  fraction = continuous - floors.astype(continuous.dtype)
  keys = jnp.where(floors < n_max, -fraction, jnp.inf)
  return floors + _smallest_first(keys, remainder).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("baseline_n", "n_min", "n_max"))
def _gvm(log_p, grad_norm, alpha, beta, *, baseline_n, n_min, n_max):
  chex.assert_rank(log_p, 1)
  chex.assert_equal_shape((log_p, grad_norm))
  budget = log_p.shape[0] * baseline_n
  log_score = gvm_log_score(log_p, grad_norm, alpha, beta)
  continuous = _gvm_continuous(log_score, jnp.asarray(budget, jnp.int32), n_min, n_max)
  counts = _largest_remainder(continuous, budget, n_min, n_max)
  return _finish(log_p, counts, continuous, baseline_n)


def gvm(log_p: jax.Array, grad_norm: jax.Array | None = None, *, baseline_n: int, n_min: int,
        n_max: int, alpha: float = GVM_ALPHA, beta: float = GVM_BETA) -> Allocation:
  """GVM-RAFT's sample sizes (arXiv 2505.02391; RLHFlow/GVM `calc_sample_ratio`), clipped.

  n_q is proportional to G_q / sqrt(p_q + alpha / p_q^(beta - 1)) (the
  gradient-variance-minimising sample size; G_q the prompt's gradient norm),
  clipped to [n_min, n_max] with the proportional scale c solved so that the
  clipped sum is B = M * baseline_n exactly (water-filling):

      continuous_q = clip(c * G_q / sqrt(p_q + alpha p_q^(1 - beta)), n_min, n_max),

  then rounded by largest remainder: floors, then one more rollout to the
  B - sum(floors) prompts below n_max with the largest fractional parts,
  ties to the smaller index. The sum is exactly B, and an unclipped prompt
  is within one rollout of its continuous share.

  Prompts with G_q = 0 or p_q = 0 (score 0; the reference code gives them
  0 samples) get n_min, unless every other prompt is at n_max: then the rest
  of the budget is split evenly over them. If no prompt has a positive
  score the allocation is uniform (baseline_n each).

  Defaults alpha = 1e-3, beta = 2 are the reference code's (em/
  stage_2_calc_sample_size.py `ScriptArguments`, runs/scripts/run_em.sh).

  Args:
    log_p: [M] log success probabilities, <= 0; -inf (p = 0) allowed.
    grad_norm: [M] gradient norms G_q >= 0, or None for ones (p alone).
    baseline_n: N0 (static); the budget is M * N0.
    n_min: the fewest rollouts of a prompt (static, >= 1).
    n_max: the most rollouts of a prompt (static).
    alpha: the penalty weight alpha >= 0 (traced).
    beta: the penalty exponent beta (traced).

  Returns:
    An `Allocation`; `continuous` holds the clipped continuous solution.

  Raises:
    ValueError: invalid log_p or grad_norm, a shape mismatch, alpha < 0, or
      bounds outside 1 <= n_min <= baseline_n <= n_max.
  """
  log_p = _log_probabilities(log_p)
  _check(baseline_n, n_min, n_max)
  if grad_norm is None:
    grad_norm = jnp.ones_like(log_p)
  grad_norm = jnp.asarray(grad_norm, log_p.dtype)
  validation.same_shape(("log_p", "grad_norm"), log_p, grad_norm)
  if validation.is_concrete(grad_norm):
    values = np.asarray(grad_norm)
    if not np.all(np.isfinite(values) & (values >= 0)):
      raise ValueError(f"grad_norm must hold finite values >= 0; got {values}.")
  if validation.is_concrete(alpha):
    validation.real("alpha", alpha, minimum=0.0)
  if validation.is_concrete(beta):
    validation.real("beta", beta)
  return _gvm(log_p, grad_norm, jnp.asarray(alpha, log_p.dtype), jnp.asarray(beta, log_p.dtype),
              baseline_n=baseline_n, n_min=n_min, n_max=n_max)


# ---------------------------------------------------------------------------------------------
# Adaptive sampling (Reinforce-Ada style).


def _adaptive_rounds(outcomes, budget, n_min, n_max, round_size):
  """Sampling rounds until every prompt stopped or the next round would exceed the budget.

  A prompt is open while n_q < n_min, or while its group is not mixed (no
  success and failure yet) and n_q < n_max. Each round gives every open
  prompt min(round_size, n_max - n_q) rollouts: its next slots of
  `outcomes` (bool [M, W >= n_max], slot j of prompt q its j-th rollout's
  success). Returns (counts [M], successes [M], rounds).
  """
  num_prompts = outcomes.shape[0]
  # successes_upto[q, n]: the successes among prompt q's first n slots.
  successes_upto = jnp.concatenate(
      [jnp.zeros((num_prompts, 1), jnp.int32), jnp.cumsum(outcomes, axis=1, dtype=jnp.int32)],
      axis=1)
  successes_of = lambda counts: jnp.take_along_axis(  # noqa: E731
      successes_upto, counts[:, None], axis=1)[:, 0]

  def is_open(counts):
    successes = successes_of(counts)
    mixed = (successes > 0) & (successes < counts)
    return (counts < n_min) | (~mixed & (counts < n_max))

  def body(state):
    rounds, counts, _ = state
    add = jnp.where(is_open(counts), jnp.minimum(round_size, n_max - counts), 0)
    proceed = jnp.any(add > 0) & (jnp.sum(counts) + jnp.sum(add) <= budget)
    return rounds + proceed.astype(jnp.int32), counts + jnp.where(proceed, add, 0), ~proceed

  rounds, counts, _ = jax.lax.while_loop(
      lambda state: ~state[2], body,
      (jnp.zeros((), jnp.int32), jnp.zeros(num_prompts, jnp.int32), jnp.asarray(False)))
  return counts, successes_of(counts), rounds


def _spread_leftover(counts, log_p, budget, n_min, n_max):
  """Tops every prompt up to n_min, then spends the rest round-robin, lowest p first.

  After k full passes a prompt with room c_q = n_max - n_q has min(k, c_q)
  more; k is the most passes the rest affords, and what is left after them
  (fewer than the prompts with room to spare) goes one each to the prompts
  with c_q > k in ascending p, ties by index.
  """
  counts = jnp.maximum(counts, n_min)
  left = budget - jnp.sum(counts)
  room = n_max - counts
  passes = jnp.arange(n_max + 1, dtype=jnp.int32)
  spent = jnp.sum(jnp.minimum(passes[:, None], room[None, :]), axis=1)  # non-decreasing in k
  k = jnp.sum(spent <= left) - 1
  counts = counts + jnp.minimum(k, room)
  last = _smallest_first(jnp.where(room > k, log_p, jnp.inf), left - spent[k])
  return counts + last.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("baseline_n", "n_min", "n_max", "round_size"))
def _adaptive(outcomes, log_p, *, baseline_n, n_min, n_max, round_size):
  chex.assert_rank(log_p, 1)
  chex.assert_rank(outcomes, 2)
  chex.assert_equal(outcomes.shape[0], log_p.shape[0])
  budget = log_p.shape[0] * baseline_n
  counts, _, _ = _adaptive_rounds(outcomes, budget, n_min, n_max, round_size)
  counts = _spread_leftover(counts, log_p, budget, n_min, n_max)
  return _finish(log_p, counts, counts.astype(log_p.dtype), baseline_n)


def bernoulli_outcomes(key: jax.Array, log_p: jax.Array, width: int) -> jax.Array:
  """bool [M, width]: independent Bernoulli(p_q) successes of every prompt's slots."""
  u = jax.random.uniform(key, (log_p.shape[0], width), log_p.dtype)
  return jnp.log(u) < log_p[:, None]


def adaptive(outcomes: jax.Array, log_p: jax.Array, *, baseline_n: int, n_min: int,
             n_max: int, round_size: int) -> Allocation:
  """Adaptive sampling in rounds with early exit, in the spirit of Reinforce-Ada.

  Reinforce-Ada (Xiong et al. 2025, "An Adaptive Sampling Framework for
  Reinforce-Style LLM Training", github RLHFlow/Reinforce-Ada, Algorithm 1)
  samples in rounds and deactivates a prompt once its group has enough
  signal. Here, the exit rule is "at least one success and one failure"
  (and n_q >= n_min): each round gives every open prompt round_size more
  rollouts (fewer if that would pass n_max); sampling stops when every
  prompt has exited or reached n_max, or when the next round would take the
  total past B = M * baseline_n.

  The rollouts' outcomes are given, slot by slot (`outcomes[q, j]`: did
  prompt q's j-th rollout succeed), so the counts are those of the very
  rollouts a gradient then uses: in the controlled setting, the successes of
  `gradients.sample_rollouts` with the key the gradient samples with; without
  rollouts, `bernoulli_outcomes`. The counts depend on the outcomes, so no
  closed-form expected gradient exists (estimate it by Monte Carlo).

  The left-over budget is then spent so that the counts sum to B exactly:
  prompts still below n_min are topped up to n_min (this always fits: a
  prompt below n_min was open in every round, so no prompt has more than
  it), and the remaining rollouts go round-robin, one per pass, to the
  prompts below n_max in ascending p (the hardest first), ties by index.

  Args:
    outcomes: bool [M, W] slot successes, W >= n_max.
    log_p: [M] log success probabilities (for the left-over order), <= 0;
      -inf (p = 0) allowed.
    baseline_n: N0 (static); the budget is M * N0.
    n_min: the fewest rollouts of a prompt (static, >= 1).
    n_max: the most rollouts of a prompt (static).
    round_size: rollouts per open prompt and round (static, >= 1).

  Returns:
    An `Allocation`; `continuous` holds the counts as floats.

  Raises:
    ValueError: invalid log_p, outcomes narrower than n_max, round_size < 1, or
      bounds outside 1 <= n_min <= baseline_n <= n_max.
  """
  log_p = _log_probabilities(log_p)
  _check(baseline_n, n_min, n_max)
  validation.integer("round_size", round_size, minimum=1)
  outcomes = jnp.asarray(outcomes, bool)
  validation.rank("outcomes", outcomes, 2)
  if outcomes.shape[0] != log_p.shape[0] or outcomes.shape[1] < n_max:
    raise ValueError(f"outcomes must be [M = {log_p.shape[0]}, >= n_max = {n_max}]; got "
                     f"{outcomes.shape}.")
  return _adaptive(outcomes, log_p, baseline_n=baseline_n, n_min=n_min, n_max=n_max,
                   round_size=round_size)
