"""Test an advantage estimator against the objective it claims: exactly, and by Monte Carlo.

For binary rewards an exchangeable group estimator is one function a(r, n, K), and its mean
group gradient is c(p, n) grad log p exactly (docs/method.md#the-estimator-and-its-scale). An
objective J has grad J = s_J(p) grad log p (`objective_scale`), so the estimator is unbiased
for J, up to a constant, exactly when c(p, n) / s_J(p) does not depend on p; that constant is
the weight a group of n rollouts gets.

* `unbiasedness` sums c(p, n) exactly (float64) over a grid of p and reports the ratio;
  `assert_unbiased` raises AssertionError with that report, naming the worst p.
* `monte_carlo_bias` z-scores the mean of independent gradient draws against an expected
  gradient, for what has no exact sum (an estimator of non-binary rewards, a training path).
* `verdicts` and `verdict_table` check every registered estimator against the objectives its
  source claims (docs/testing_estimators.md holds the table).

Plain functions for users' test suites; this module imports the method layer only.
"""

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from scipy import stats

from sera_jax.method import estimators, validation
from sera_jax.method.estimators import Estimator, objective_scale

__all__ = ["MonteCarloBias", "Unbiasedness", "assert_unbiased", "monte_carlo_bias",
           "objective_scale", "unbiasedness", "verdict_table", "verdicts"]

# The default grid: 41 values of p evenly spaced in log-odds from 1e-4 to 1 - 1e-4.
_EDGE = 1e-4
_GRID_POINTS = 41
RTOL = 1e-6  # float64 sums agree with closed forms to ~1e-12; an eps > 0 moves them more
TABLE_PARAMS = {"maclaurin": {"order": 8}, "maclaurin_baseline": {"order": 8}, "pkpo": {"k": 4}}
TABLE_NS = range(1, 17)


def _default_log_p() -> np.ndarray:
  logit = math.log((1 - _EDGE) / _EDGE)
  x = np.linspace(-logit, logit, _GRID_POINTS)
  return -np.logaddexp(0.0, -x)  # log sigmoid(x), exact at both ends


class Unbiasedness(NamedTuple):
  """How far c(p, n) / s_J(p) is from a constant over a grid of p.

  Attributes:
    estimator: the estimator, with its parameters.
    objective: the objective J, its order a number.
    n: the group size.
    unbiased: the ratio is a positive constant to `rtol` (relative): E[g] = scale * grad J.
    scale: the ratio's median: for an unbiased estimator the weight a group of n gets.
    max_deviation: the largest |ratio / scale - 1| (inf when scale <= 0).
    worst_p: where it is.
    rtol: the tolerance.
    p: [P] the grid (float64).
    ratio: [P] c(p, n) / s_J(p) there.
  """
  estimator: str
  objective: str
  n: int
  unbiased: bool
  scale: float
  max_deviation: float
  worst_p: float
  rtol: float
  p: np.ndarray
  ratio: np.ndarray

  def __str__(self) -> str:
    where = f"for {self.objective} at n = {self.n}"
    span = f"p in [{self.p.min():.4g}, {self.p.max():.4g}]"
    if self.unbiased:
      return (f"{self.estimator} is unbiased {where}: E[g] = {self.scale:.6g} grad J for {span} "
              f"(largest relative deviation {self.max_deviation:.2g} at p = {self.worst_p:.6g}, "
              f"rtol {self.rtol:g}).")
    if not self.scale > 0:
      what = "no signal" if np.all(self.ratio == 0) else "no positive multiple of grad J"
      return (f"{self.estimator} is not unbiased {where}: {what}; c(p, n) / s_J(p) = "
              f"{self.ratio[np.argmax(np.abs(self.ratio))]:.6g} at p = {self.worst_p:.6g}, "
              f"median {self.scale:.6g} over {span}.")
    return (f"{self.estimator} is not unbiased {where}: c(p, n) / s_J(p) runs from "
            f"{self.ratio.min():.6g} to {self.ratio.max():.6g} over {span}; its largest "
            f"relative deviation from the median {self.scale:.6g} is {self.max_deviation:.3g}, "
            f"at p = {self.worst_p:.6g} (rtol {self.rtol:g}).")


def _report(estimator: str, objective: str, n: int, p: np.ndarray, ratio: np.ndarray,
            rtol: float) -> Unbiasedness:
  scale = float(np.median(ratio))
  if scale > 0:
    deviation = np.abs(ratio / scale - 1)
    worst = int(np.argmax(deviation))
    max_deviation = float(deviation[worst])
  else:
    worst, max_deviation = int(np.argmax(np.abs(ratio))), math.inf
  return Unbiasedness(estimator, objective, n, bool(max_deviation <= rtol), scale,
                      max_deviation, float(p[worst]), rtol, p, ratio)


def _grid(p) -> tuple[np.ndarray, np.ndarray]:
  """(p, log p) in float64, the default grid when p is None."""
  if p is None:
    log_p = _default_log_p()
    return np.exp(log_p), log_p
  p = np.atleast_1d(np.asarray(p, np.float64))
  if not np.all((p > 0) & (p < 1)):
    raise ValueError(f"p must lie strictly between 0 and 1; got {p}.")
  if np.unique(p).size < 2:  # a ratio at one p is constant whatever the estimator
    raise ValueError(f"p must hold at least two distinct values to compare c(p, n) across; "
                     f"got {p}.")
  return p, np.log(p)


def _scales(spec: Estimator, log_p: np.ndarray, ns: np.ndarray, eps: float) -> np.ndarray:
  """[P, len(ns)] exact c(p, n) in float64."""
  with jax.enable_x64(True):
    return np.asarray(estimators.expected_scale(spec, log_p[:, None], ns[None, :], eps=eps,
                                                max_n=int(ns.max())))


def _objective_scale(objective: str, log_p: np.ndarray) -> np.ndarray:
  with jax.enable_x64(True):
    return np.asarray(objective_scale(objective, log_p))


def unbiasedness(estimator: "str | Callable | Estimator", objective: str, *, n: int, p=None,
                 eps: float = 0.0, rtol: float = RTOL, **params) -> Unbiasedness:
  """Whether an estimator is unbiased for an objective with groups of n, summed exactly.

  Args:
    estimator: a registered name, a function a(reward, group_size, successes) of jnp arrays,
      or an `Estimator` (as `sera_jax.advantages` takes them).
    objective: "p", "log_p", "pass@K" or "truncated@T" (`objective_scale`); the order may be
      "n", "n-1" or a parameter's name ("pass@k").
    n: the group size (>= 1).
    p: the success probabilities to compare at, in (0, 1), at least two distinct ones;
      default 41 values evenly spaced in log-odds from 1e-4 to 1 - 1e-4.
    eps: passed to estimators that take it; 0 tests the formula without its stabiliser (an
      eps > 0 moves c(p, n) by about eps / p at small p).
    rtol: the relative tolerance on the ratio's constancy.
    **params: the estimator's keyword parameters (k=4, order=8).

  Returns:
    The `Unbiasedness` report; `str(report)` says it in a sentence.
  """
  spec = estimators.estimator_spec(estimator, **params)
  n = validation.integer("n", n, minimum=1)
  objective = estimators.resolve_objective(objective, n, dict(spec.params))
  p, log_p = _grid(p)
  ratio = _scales(spec, log_p, np.asarray([n]), eps)[:, 0] / _objective_scale(objective, log_p)
  return _report(str(spec), objective, n, p, ratio, rtol)


def assert_unbiased(estimator: "str | Callable | Estimator", objective: str, *, n: int,
                    **kwargs) -> Unbiasedness:
  """`unbiasedness`, raising AssertionError with its report when the estimator is not.

  Returns:
    The report, when unbiased.
  """
  report = unbiasedness(estimator, objective, n=n, **kwargs)
  if not report.unbiased:
    raise AssertionError(str(report))
  return report


# --- Monte Carlo ------------------------------------------------------------------------------


class MonteCarloBias(NamedTuple):
  """z-scores of a Monte Carlo mean against an expected value on fixed directions.

  Attributes:
    z: [J] (mean - expected) / (std / sqrt(R)) of each direction's projection.
    limit: the |z| above which a direction detects a bias.
    false_alarm: the chance that some |z| exceeds `limit` when the draws' mean is the
      expected one (Bonferroni over the J directions; Student's t for each).
    draws: R.
    consistent: every |z| <= limit: no bias detected.
    worst: the direction of the largest |z|.
  """
  z: np.ndarray
  limit: float
  false_alarm: float
  draws: int
  consistent: bool
  worst: int

  def __str__(self) -> str:
    verdict = "consistent with" if self.consistent else "biased against"
    return (f"the mean of {self.draws} draws is {verdict} the expected value: largest |z| = "
            f"{abs(self.z[self.worst]):.2f} on direction {self.worst} of {len(self.z)} (limit "
            f"{self.limit:.2f}, false-alarm rate {self.false_alarm:g}); z = "
            f"{np.array2string(self.z, precision=2)}.")


def monte_carlo_bias(draws, expected, *, directions=None, num_directions: int = 8,
                     false_alarm: float = 1e-3, seed: int = 0) -> MonteCarloBias:
  """z-scores of the mean of independent gradient draws against an expected gradient.

  For what has no exact sum: an estimator of non-binary rewards, or a whole training path
  (sampling, rewards, loss, autodiff). Each direction d gives z = (mean_r <d, g_r> - <d,
  expected>) / (std_r <d, g_r> / sqrt(R)). The directions must not depend on the draws (fixed
  before drawing, or drawn from `seed`): directions chosen after looking would void the rate.

  The false-alarm rate: for draws whose mean is `expected`, each z is Student's t with R - 1
  degrees of freedom when the projections are normal, and nearly so for other draws when R is
  in the hundreds (central limit theorem; skewed, heavy-tailed draws need more; take R >= 20,
  where the quantile below is exact to 0.1%). The limit is
  t's two-sided quantile at false_alarm / J, so by Bonferroni the chance that any of the J
  directions exceeds it is at most `false_alarm`, however the directions correlate.

  Args:
    draws: [R, ...] R >= 2 independent draws of the gradient (each flattened).
    expected: [...] the gradient their mean should be.
    directions: [J, D] directions in the flattened space (any norm). Default: `expected`'s
      own (when non-zero) and num_directions - 1 standard normal ones from `seed`. Pass
      np.eye(D) for every coordinate.
    num_directions: J for the default directions.
    false_alarm: the family-wise false-alarm rate, in (0, 1).
    seed: the seed of the default random directions.

  Returns:
    The `MonteCarloBias` report: `assert report.consistent, report` in a test.
  """
  samples = np.asarray(draws, np.float64)
  count = samples.shape[0] if samples.ndim else 0
  if count < 2:
    raise ValueError(f"draws must hold R >= 2 draws along its first axis; got shape "
                     f"{samples.shape}.")
  samples = samples.reshape(count, -1)
  target = np.asarray(expected, np.float64).reshape(-1)
  if target.size != samples.shape[1]:
    raise ValueError(f"expected has {target.size} entries, a draw {samples.shape[1]}.")
  if not 0 < false_alarm < 1:
    raise ValueError(f"false_alarm must lie in (0, 1); got {false_alarm}.")
  if directions is None:
    num_directions = validation.integer("num_directions", num_directions, minimum=1)
    directions = np.random.default_rng(seed).normal(size=(num_directions, target.size))
    if np.any(target != 0):
      directions[0] = target
  directions = np.asarray(directions, np.float64).reshape(-1, target.size)
  norms = np.linalg.norm(directions, axis=1, keepdims=True)
  if not np.all(norms > 0):
    raise ValueError("directions must be non-zero.")
  directions = directions / norms
  projected = samples @ directions.T  # [R, J]
  error = projected.mean(0) - directions @ target
  stderr = projected.std(0, ddof=1) / np.sqrt(count)
  with np.errstate(divide="ignore", invalid="ignore"):  # a constant projection: exact or not
    z = np.where(stderr > 0, error / stderr, np.where(error == 0, 0.0, np.inf * np.sign(error)))
  limit = float(stats.t.ppf(1 - false_alarm / (2 * len(z)), count - 1))
  worst = int(np.argmax(np.abs(z)))
  return MonteCarloBias(z, limit, false_alarm, count, bool(np.all(np.abs(z) <= limit)), worst)


# --- the registry's verdicts ------------------------------------------------------------------


def _runs(ns: list[int]) -> str:
  """'1, 3..5, 8' for [1, 3, 4, 5, 8]."""
  runs, start = [], None
  for i, n in enumerate(ns):
    start = n if start is None else start
    if i + 1 == len(ns) or ns[i + 1] != n + 1:
      runs.append(f"{start}" if start == n else f"{start}..{n}")
      start = None
  return ", ".join(runs)


def verdicts(names: Iterable[str] | None = None, *, ns: Iterable[int] = TABLE_NS,
             params: Mapping[str, Mapping[str, Any]] | None = None, eps: float = 0.0,
             rtol: float = RTOL) -> dict[str, dict[str, str]]:
  """Each registered estimator against each objective its source claims, over group sizes.

  Args:
    names: registered names (default: every one).
    ns: the group sizes to check.
    params: name -> keyword parameters, for the parameterised estimators (default
      `TABLE_PARAMS`).
    eps, rtol: as in `unbiasedness`.

  Returns:
    {name: {claimed objective: "unbiased at n = 2..16; no signal at n = 1"}}, each n counted
    as unbiased, biased, or no signal (c(p, n) = 0 at every p); n where the claim has no
    order >= 1 (truncated@n-1 at n = 1) are left out. {} for a source that claims nothing.
  """
  registry = estimators.registered_estimators()
  params = TABLE_PARAMS if params is None else params
  ns = np.asarray(sorted(set(ns)))
  log_p = _default_log_p()
  out = {}
  for name in registry if names is None else names:
    spec = estimators.estimator_spec(name, **params.get(name, {}))
    scales = _scales(spec, log_p, ns, eps)
    out[name] = {}
    for claim in registry[name].objectives:
      found: dict[str, list[int]] = {"unbiased": [], "biased": [], "no signal": []}
      for column, n in enumerate(ns.tolist()):
        try:
          objective = estimators.resolve_objective(claim, n, dict(spec.params))
        except ValueError:  # a constant objective at this n
          continue
        ratio = scales[:, column] / _objective_scale(objective, log_p)
        report = _report(str(spec), objective, n, np.exp(log_p), ratio, rtol)
        kind = ("unbiased" if report.unbiased else "no signal" if not np.any(ratio) else "biased")
        found[kind].append(n)
      out[name][claim] = "; ".join(f"{kind} at n = {_runs(found[kind])}"
                                   for kind in found if found[kind])
  return out


def verdict_table(**kwargs) -> str:
  """The markdown table of docs/testing_estimators.md: every registered estimator, its formula,
  source, closed-form c(p, n) and `verdicts` (kwargs as there)."""
  registry = estimators.registered_estimators()
  params = kwargs.get("params") or TABLE_PARAMS
  found = verdicts(**kwargs)
  rows = ["| estimator | advantage a(r, n, K), mu = K / n | source | c(p, n) at eps = 0 "
          "| claimed objective: verdict |", "|---|---|---|---|---|"]
  for name, claims in found.items():
    entry = registry[name]
    shown = ", ".join(f"{key}={value}" for key, value in params.get(name, {}).items())
    label = f"`{name}` ({shown})" if shown else f"`{name}`"
    scale = f"`{entry.scale}`" if entry.scale else "the sum only"
    verdict = "<br>".join(f"{claim}: {text}" for claim, text in claims.items())
    rows.append(f"| {label} | `{entry.formula}` | {entry.source} | {scale} "
                f"| {verdict or 'none stated'} |")
  return "\n".join(rows) + "\n"
