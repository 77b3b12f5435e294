"""An independent float64 NumPy reference of docs/method.md#the-estimator-and-its-scale (no JAX).

Everything here is written from the specification, not from `sera_jax`, in
plain vectorized NumPy and float64, so that it can serve both as the oracle
the JAX library is checked against and as the CPU speed baseline of the
allocator: the waterline bisection (docs/method.md#the-waterline) runs over whole arrays of prompts,
and the active-set search (docs/method.md#the-active-set) calls it O(log M) times.

The numerics are spelled out exactly (the same log-space forms, the same 100
bisection steps on log tau, the same tie-breaks) so that, in float64, the
library can agree with this module count for count and, up to the rounding of
reductions, bit for bit.

Inputs are log success probabilities log p (finite, <= 0).
"""

import math
from typing import NamedTuple

import numpy as np

MODES = ("uniform", "equalized", "sera")
ESTIMATORS = ("maxrl", "maxrl_plain", "grpo", "grpo_sample_std", "rloo", "reinforce")
# Estimators whose expected scale has a closed form at eps = 0
# (docs/method.md#the-estimator-and-its-scale).
CLOSED_FORM_ESTIMATORS = ("maxrl", "maxrl_plain", "reinforce", "rloo")

BISECTION_STEPS = 100  # docs/method.md#the-waterline: exactly 100 steps on log(tau).
USEFUL_SLACK = 1e-12  # docs/method.md#the-active-set: useful(k) tests mixed >= threshold - 1e-12.

_LOG_HALF = -math.log(2.0)
# The smallest *normal* float64: XLA flushes subnormals to zero, so this (not
# the smallest subnormal) is the lower end of the bisection when n_min = 1.
_TINY = float(np.finfo(np.float64).tiny)
# The documented probability clamp p in [tiny, 1 - ulp]
# (docs/method.md#the-estimator-and-its-scale).
LOG_P_MIN = float(np.log(_TINY))
LOG_P_MAX = float(np.log1p(-np.finfo(np.float64).epsneg))


class Allocation(NamedTuple):
  """The result of `allocate`, one entry per prompt.

  See docs/method.md#the-waterline to docs/method.md#weights-and-the-loss.

  Attributes:
    counts: int64 [M] rollouts n_q, in {0} ∪ [n_min, n_max], summing to M * N0.
    weights: float64 [M] prompt weights w_q of docs/method.md#weights-and-the-loss.
    active: bool [M], True where the prompt takes part (n_q > 0).
    continuous: float64 [M] the waterline solution n_q(tau) before rounding
      (n_min at the degenerate budget, N0 in "uniform", 0 when inactive).
    target_fidelity: the waterline 1 - exp(-tau) (see `allocate`).
    fidelity: float64 [M] kappa(p_q, n_q).
    coverage: float64 [M] coverage(p_q, n_q) = pass@n_q.
  """
  counts: np.ndarray
  weights: np.ndarray
  active: np.ndarray
  continuous: np.ndarray
  target_fidelity: float
  fidelity: np.ndarray
  coverage: np.ndarray


def _as_float(x) -> np.ndarray:
  return np.asarray(x, dtype=np.float64)


def _check_log_p(log_p) -> np.ndarray:
  log_p = _as_float(log_p)
  for bad, what in ((np.isnan(log_p), "NaN"), (log_p > 0, "a positive value (p > 1)"),
                    (np.isneginf(log_p), "-inf (p = 0)")):
    if bad.any():
      index = tuple(int(i) for i in np.argwhere(bad)[0])
      raise ValueError(f"log_p must hold finite log-probabilities <= 0; found {what} "
                       f"at index {index}: {log_p[index]!r}.")
  return log_p


def clamp_log_p(log_p) -> np.ndarray:
  """Clamps p to [tiny, 1 - ulp] in log space (the documented clamp)."""
  return np.clip(_as_float(log_p), LOG_P_MIN, LOG_P_MAX)


def log1mexp(x) -> np.ndarray:
  """log(1 - exp(x)) for x <= 0 (Maechler 2012): log(-expm1 x) above -ln 2, else log1p(-exp x)."""
  x = _as_float(x)
  near_zero = x > _LOG_HALF
  with np.errstate(divide="ignore"):  # x = 0 gives -inf, which is right.
    return np.where(near_zero, np.log(-np.expm1(np.where(near_zero, x, _LOG_HALF))),
                    np.log1p(-np.exp(np.where(near_zero, _LOG_HALF, x))))


def failure_rate(log_p) -> np.ndarray:
  """lam = -log(1 - p) (docs/method.md#the-waterline)."""
  return -log1mexp(log_p)


def _log_failure_power(log_p, n) -> np.ndarray:
  """n log(1 - p), taken as 0 when n == 0 (so p = 1, n = 0 gives (1 - p)^0 = 1)."""
  log_p, n = np.broadcast_arrays(_as_float(log_p), _as_float(n))
  with np.errstate(invalid="ignore"):
    return np.where(n == 0, 0.0, n * log1mexp(log_p))


def fidelity(log_p, n) -> np.ndarray:
  """kappa(p, n) = 1 - (1 - p)^(n - 1) for n >= 1, 0 for n = 0.

  See docs/method.md#the-estimator-and-its-scale.
  """
  n = _as_float(n)
  kappa = -np.expm1(_log_failure_power(log_p, np.maximum(n - 1, 0)))
  return np.where(n >= 1, kappa, 0.0)


def coverage(log_p, n) -> np.ndarray:
  """pass@n = 1 - (1 - p)^n (docs/method.md#the-estimator-and-its-scale), 0 at n = 0."""
  return -np.expm1(_log_failure_power(log_p, n))


def mixed(log_p, n) -> np.ndarray:
  """P(0 < K < n) = 1 - (1 - p)^n - p^n for n > 1, else 0, clipped to [0, 1].

  See docs/method.md#the-active-set.

  The larger of (1 - p)^n and p^n goes through expm1: for p < 1/2 the value is
  -expm1(n log(1 - p)) - exp(n log p), otherwise -expm1(n log p) - exp(n log(1 - p)).
  """
  log_p, n = np.broadcast_arrays(_as_float(log_p), _as_float(n))
  log_fail_n = _log_failure_power(log_p, n)
  log_success_n = n * log_p
  small_p = log_p < _LOG_HALF
  value = np.where(small_p, -np.expm1(log_fail_n) - np.exp(log_success_n),
                   -np.expm1(log_success_n) - np.exp(log_fail_n))
  return np.where(n > 1, np.clip(value, 0.0, 1.0), 0.0)  # n = 1 is never mixed


class Equalized(NamedTuple):
  """Integer counts for a set of prompts that are all active.

  See docs/method.md#the-waterline and docs/method.md#integer-rounding.
  """
  counts: np.ndarray
  continuous: np.ndarray
  target_fidelity: float


def waterline(lam: np.ndarray, budget: int, n_min: int, n_max: int) -> tuple[np.ndarray, float]:
  """The continuous waterline of docs/method.md#the-waterline by 100 bisection steps on log tau.

  Requires len(lam) * n_min < budget <= len(lam) * n_max (the caller handles
  the degenerate budget len(lam) * n_min).

  Args:
    lam: [k] failure rates -log(1 - p_q) > 0 of the active prompts.
    budget: total rollouts to spread.
    n_min: lower clip of n_q(tau).
    n_max: upper clip of n_q(tau).

  Returns:
    (continuous, tau): n_q(tau) = clip(1 + tau / lam_q, n_min, n_max) and tau.
  """
  if n_max < 2:
    raise ValueError(f"n_max must be >= 2 when the budget exceeds k * n_min; got {n_max}.")
  tau_lo = (n_min - 1) * lam.min() if n_min > 1 else _TINY
  tau_hi = (n_max - 1) * lam.max()
  lo, hi = np.log(tau_lo), np.log(tau_hi)
  with np.errstate(over="ignore"):  # tau / lam -> inf for lam near tiny is clipped to n_max.
    for _ in range(BISECTION_STEPS):
      mid = 0.5 * (lo + hi)
      if np.clip(1.0 + np.exp(mid) / lam, n_min, n_max).sum() > budget:
        hi = mid
      else:
        lo = mid
    tau = np.exp(lo)
    return np.clip(1.0 + tau / lam, n_min, n_max), float(tau)


def marginal_error_keys(log_p: np.ndarray, counts: np.ndarray, log_gap: float) -> np.ndarray:
  """Keys increasing in the marginal error of docs/method.md#integer-rounding.

  e_q = (kappa(n + 1) - target)^2 - (kappa(n) - target)^2 = (1 - target)^2 g_q with
  g_q = -r p (expm1(x + log q) + expm1(x)), x = log r = (n - 1) log q - log_gap and
  log_gap = log(1 - target): kappa rounds to 1 in floats for easy prompts, and
  (kappa - target)^2 differences cancel for hard ones; g does neither. The key is
  sign(g) / (1 - 2 log(epsneg) - log|g|): |g| <= 1 / q^2 <= 1 / epsneg^2 under the clamp.
  """
  log_q = log1mexp(log_p)
  x = _log_failure_power(log_p, np.maximum(counts - 1, 0)) - log_gap
  ceiling = 1.0 - 2.0 * math.log(np.finfo(np.float64).epsneg)
  with np.errstate(over="ignore", divide="ignore", invalid="ignore"):  # non-candidates
    s = np.expm1(x + log_q) + np.expm1(x)
    return -np.sign(s) / (ceiling - (x + log_p + np.log(np.abs(s))))


def round_to_budget(log_p: np.ndarray, continuous: np.ndarray, log_gap: float, budget: int,
                    n_min: int, n_max: int) -> np.ndarray:
  """Integer rounding of docs/method.md#integer-rounding.

  counts = clip(floor(continuous), n_min, n_max); the R = budget - sum(counts)
  remaining rollouts go one each to the candidates (counts < n_max) with the
  smallest marginal error (kappa(n + 1) - target)^2 - (kappa(n) - target)^2
  (`marginal_error_keys`, from log_gap = log(1 - target)), ties to the smaller index
  (a stable sort).
  """
  counts = np.clip(np.floor(continuous), n_min, n_max).astype(np.int64)
  remaining = budget - int(counts.sum())
  if remaining < 0:
    raise RuntimeError(f"internal error: floor of the waterline overspends by {-remaining}.")
  candidates = counts < n_max
  if remaining > int(candidates.sum()):
    raise RuntimeError(f"internal error: {remaining} rollouts left for "
                       f"{int(candidates.sum())} prompts below n_max.")
  if remaining:
    keys = marginal_error_keys(log_p, counts, log_gap)
    order = np.argsort(np.where(candidates, keys, np.inf), kind="stable")
    counts[order[:remaining]] += 1
  return counts


def equalized(log_p: np.ndarray, budget: int, n_min: int, n_max: int) -> Equalized:
  """Mode "equalized" on the given (all active) prompts.

  See docs/method.md#the-waterline, then docs/method.md#integer-rounding.

  Args:
    log_p: [k] clamped log success probabilities, in ascending prompt order.
    budget: total rollouts, with k * n_min <= budget <= k * n_max.
    n_min: fewest rollouts of a prompt.
    n_max: most rollouts of a prompt.
  """
  k = log_p.size
  if not k * n_min <= budget <= k * n_max:
    raise ValueError(f"budget {budget} is infeasible for {k} prompts with n in "
                     f"[{n_min}, {n_max}].")
  if budget == k * n_min:
    continuous = np.full(k, float(n_min))
    return Equalized(np.full(k, n_min, np.int64), continuous,
                     float(fidelity(log_p, n_min).min()))
  continuous, tau = waterline(failure_rate(log_p), budget, n_min, n_max)
  return Equalized(round_to_budget(log_p, continuous, -tau, budget, n_min, n_max),
                   continuous, float(-np.expm1(-tau)))


def select_active(log_p: np.ndarray, budget: int, n_min: int, n_max: int,
                  threshold: float) -> tuple[np.ndarray, Equalized]:
  """The active-set search of docs/method.md#the-active-set.

  Returns:
    (active prompt indices in ascending order, their `Equalized` allocation
    of the whole budget).
  """
  score = mixed(log_p, n_max)
  # The order of -score, ranked by log(1 - mixed) so that prompts whose mixed
  # probability rounds to 1 are not tied (and then ordered by index) in floats.
  log_unmixed = np.logaddexp(_log_failure_power(log_p, n_max), n_max * log_p)
  ranking = np.argsort(log_unmixed, kind="stable")
  eligible = int((score >= threshold).sum())
  required = -(-budget // n_max)
  results = {}

  def alloc(k):
    if k not in results:
      index = np.sort(ranking[:k])
      results[k] = index, equalized(log_p[index], budget, n_min, n_max)
    return results[k]

  def useful(k):
    index, result = alloc(k)
    return bool((mixed(log_p[index], result.counts) >= threshold - USEFUL_SLACK).all())

  selected = required
  if eligible >= required:
    lo, hi = required, eligible
    while lo <= hi:
      mid = (lo + hi) // 2
      if useful(mid):
        selected, lo = mid, mid + 1
      else:
        hi = mid - 1
  return alloc(selected)


def _check_int(name: str, value) -> int:
  if isinstance(value, bool) or int(value) != value:
    raise TypeError(f"{name} must be an integer; got {value!r}.")
  return int(value)


def allocate(log_p, baseline_n: int, n_min: int, n_max: int, mode: str = "sera",
             threshold: float = 0.05, normalize_by_rollout_count: bool = True,
             normalize_by_rho: bool = False) -> Allocation:
  """Allocates B = M * baseline_n rollouts over M prompts, in float64.

  See docs/method.md#the-waterline to docs/method.md#weights-and-the-loss.

  target_fidelity is 1 - exp(-tau) for the waterline tau (docs/method.md#the-waterline); at
  the degenerate budget (every active prompt at n_min) it is the smallest kappa(p_q, n_min)
  over active prompts, and in "uniform" mode the smallest kappa(p_q, N0) over all prompts
  (the convention of the library).

  Args:
    log_p: [M] log success probabilities, finite and <= 0; clamped to p in [tiny, 1 - ulp].
    baseline_n: N0; the budget is M * N0.
    n_min: fewest rollouts of an active prompt, 1 <= n_min <= N0.
    n_max: most rollouts of one prompt, N0 <= n_max.
    mode: "uniform", "equalized" or "sera".
    threshold: minimum mixed-group probability of an active prompt, in [0, 1] ("sera").
    normalize_by_rollout_count: weights N0 / n_q (True) or 1 (False) on active prompts.
    normalize_by_rho: divide the weights by the mean active coverage (not in "uniform").

  Returns:
    An `Allocation`.

  Raises:
    ValueError: bad log-probabilities, infeasible bounds, unknown mode, threshold outside [0, 1].
  """
  log_p = _check_log_p(log_p)
  if log_p.ndim != 1 or log_p.size == 0:
    raise ValueError(f"log_p must be a non-empty vector; got shape {log_p.shape}.")
  baseline_n, n_min, n_max = (_check_int(name, v) for name, v in (
      ("baseline_n", baseline_n), ("n_min", n_min), ("n_max", n_max)))
  if n_min < 1:
    raise ValueError(f"n_min must be >= 1; got n_min={n_min}.")
  if n_min > baseline_n:
    raise ValueError(f"n_min must be <= baseline_n; got n_min={n_min}, baseline_n={baseline_n}.")
  if baseline_n > n_max:
    raise ValueError(f"baseline_n must be <= n_max; got baseline_n={baseline_n}, n_max={n_max}.")
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}; got {mode!r}.")
  threshold = float(threshold)
  if not 0.0 <= threshold <= 1.0:
    raise ValueError(f"threshold must lie in [0, 1]; got {threshold}.")

  log_p = clamp_log_p(log_p)
  num_prompts = log_p.size
  budget = num_prompts * baseline_n
  active = np.ones(num_prompts, bool)
  if mode == "uniform":
    counts = np.full(num_prompts, baseline_n, np.int64)
    continuous = np.full(num_prompts, float(baseline_n))
    target = float(fidelity(log_p, baseline_n).min())
  elif mode == "equalized":
    counts, continuous, target = equalized(log_p, budget, n_min, n_max)
  else:
    index, (sub_counts, sub_continuous, target) = select_active(
        log_p, budget, n_min, n_max, threshold)
    active = np.zeros(num_prompts, bool)
    active[index] = True
    counts = np.zeros(num_prompts, np.int64)
    counts[index] = sub_counts
    continuous = np.zeros(num_prompts)
    continuous[index] = sub_continuous

  weighted = active & (counts > 0)
  per_prompt = baseline_n / np.maximum(counts, 1) if normalize_by_rollout_count else 1.0
  weights = np.where(weighted, per_prompt, 0.0)
  cover = coverage(log_p, counts)
  if normalize_by_rho and mode != "uniform":
    weights = weights / cover[active].mean()
  return Allocation(counts, weights, active, continuous, target,
                    fidelity(log_p, counts), cover)


# --- Expected scale of the group estimators, closed form by summing over K ---
# (docs/method.md#the-estimator-and-its-scale).


def advantage_pair(estimator: str, successes: np.ndarray, n: np.ndarray,
                   eps: float) -> tuple[np.ndarray, np.ndarray]:
  """(a_s(K), a_f(K)): the advantage of a success and of a failure in a group of n with K successes.

  * maxrl:       (r - mu) / (mu + eps), both 0 when K = 0   (mu = K / n)
  * maxrl_plain: r / (mu + eps), 0 when K = 0
  * grpo:        (r - mu) / (std + eps), std = sqrt(mu (1 - mu)) (0 when std = 0)
  * grpo_sample_std: (r - mu) / (s + eps), s = sqrt(n mu (1 - mu) / (n - 1)) (0 when s = 0)
  * rloo:        r - (K - r) / (n - 1), 0 when n = 1
  * reinforce:   r - mu
  """
  k, n = np.broadcast_arrays(_as_float(successes), _as_float(n))
  with np.errstate(divide="ignore", invalid="ignore"):
    mu = k / n
    if estimator == "maxrl":
      a_s, a_f = (1 - mu) / (mu + eps), -mu / (mu + eps)
      none = k == 0
    elif estimator == "maxrl_plain":
      a_s, a_f = 1 / (mu + eps), np.zeros_like(mu)
      none = k == 0
    elif estimator == "grpo":
      std = np.sqrt(mu * (1 - mu))
      a_s, a_f = (1 - mu) / (std + eps), -mu / (std + eps)
      none = std == 0  # all-same group: r - mu = 0 for everyone.
    elif estimator == "grpo_sample_std":
      s = np.sqrt(n * mu * (1 - mu) / (n - 1))  # NaN at n = 1: a group of one is all-same
      a_s, a_f = (1 - mu) / (s + eps), -mu / (s + eps)
      none = ~(s > 0)
    elif estimator == "rloo":
      a_s, a_f = 1 - (k - 1) / (n - 1), -k / (n - 1)
      none = n == 1
    elif estimator == "reinforce":
      a_s, a_f = 1 - mu, -mu
      none = np.zeros(mu.shape, bool)
    else:
      raise ValueError(f"estimator must be one of {ESTIMATORS}; got {estimator!r}.")
  return np.where(none, 0.0, a_s), np.where(none, 0.0, a_f)


def _log_binomial_coefficients(n: int) -> np.ndarray:
  # Exact big-int binomials, then one rounding: far more accurate than lgamma differences.
  return np.array([math.log(math.comb(n, k)) for k in range(n + 1)])


def expected_scale(estimator: str, log_p, n, eps: float = 1e-6) -> np.ndarray:
  """c(p, n) = (1/n) sum_K Binom(K; n, p) [K a_s(K) - (n - K) a_f(K) p / (1 - p)].

  See docs/method.md#the-estimator-and-its-scale.

  The sum is taken as written, with the binomial pmf in log space and
  Binom(K; n, p) p / (1 - p) as exp(log pmf + log p - log(1 - p)); c = 0 at n = 0.
  p is clamped to [tiny, 1 - ulp] as in `allocate`.

  Args:
    estimator: one of `ESTIMATORS`.
    log_p: log success probabilities, finite and <= 0.
    n: rollout counts (integers >= 0), broadcastable against log_p.
    eps: the advantage's eps.

  Returns:
    float64 array of the broadcast shape.
  """
  if estimator not in ESTIMATORS:
    raise ValueError(f"estimator must be one of {ESTIMATORS}; got {estimator!r}.")
  log_p, n = np.broadcast_arrays(clamp_log_p(_check_log_p(log_p)), np.asarray(n))
  if np.any(n < 0) or np.any(n != np.round(n)):
    raise ValueError(f"n must hold integers >= 0; got {n!r}.")
  n = n.astype(np.int64)
  scale = np.zeros(log_p.shape)
  log_q = log1mexp(log_p)
  log_odds = log_p - log_q
  for size in np.unique(n[n > 0]):  # one vectorized sum per distinct group size.
    at = n == size
    k = np.arange(size + 1, dtype=np.float64)
    lp, lq, lo = log_p[at][:, None], log_q[at][:, None], log_odds[at][:, None]
    log_pmf = _log_binomial_coefficients(int(size)) + k * lp + (size - k) * lq
    a_s, a_f = advantage_pair(estimator, k, size, eps)
    success_term = k * a_s * np.exp(log_pmf)
    failure_term = np.where(k < size, (size - k) * a_f * np.exp(log_pmf + lo), 0.0)
    scale[at] = (success_term - failure_term).sum(axis=-1) / size
  return scale


def closed_form_scale(estimator: str, log_p, n) -> np.ndarray:
  """The eps -> 0 closed forms: kappa, coverage, (1 - 1/n) p, p (rloo, n >= 2).

  See docs/method.md#the-estimator-and-its-scale.
  """
  log_p, n = np.broadcast_arrays(clamp_log_p(log_p), _as_float(n))
  p = np.exp(log_p)
  if estimator == "maxrl":
    return fidelity(log_p, n)
  if estimator == "maxrl_plain":
    return coverage(log_p, n)
  if estimator == "reinforce":
    return np.where(n > 0, (1 - 1 / np.maximum(n, 1)) * p, 0.0)
  if estimator == "rloo":
    return np.where(n >= 2, p, 0.0)
  raise ValueError(f"no closed form for estimator {estimator!r}; "
                   f"those with one: {CLOSED_FORM_ESTIMATORS}.")
