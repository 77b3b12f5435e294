"""Group advantage estimators for binary rewards, their exact scales, and the loss.

Every estimator here gives rollout j of a group an advantage that depends only
on its own reward r_j, the group size n and the group's success count K
(docs/method.md#the-estimator-and-its-scale). That one per-rollout formula,
`rollout_advantage(r, n, K)`, is shared by

* `advantages`, which evaluates it on padded reward tensors [M, N],
* `expected_scale`, which evaluates it at r = 1 (a_s(K)) and r = 0 (a_f(K)) to
  sum the closed form c(p, n) of docs/method.md#the-estimator-and-its-scale exactly, and
* `sera_jax.method.flat.flat_advantages`, on a flat buffer with segment ids,

so they cannot drift apart. `policy_loss` is the surrogate loss of
docs/method.md#weights-and-the-loss.

Estimators are values. Each of those functions takes a registered name (SERA's own are
`ESTIMATORS`; `registered_estimators()` lists every one with its source and the objectives
that source claims), or any function a(reward, group_size, successes) of jnp arrays, with
keyword parameters for the parameterised ones (`k=4`, `order=8`). Either resolves to an
`Estimator`, a hashable spec that jit treats as static: the same estimator and parameters
compile once. `register_estimator` adds a name. `objective_scale` is the scale an unbiased
estimator of each objective has; `sera_jax.testing` compares the two.
"""

import functools
import inspect
import re
import types
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import gammaln

from sera_jax.method import validation
from sera_jax.method.scaling import log1mexp

# SERA's own estimators, the ones its training loops accept; the registry holds more.
ESTIMATORS = ("maxrl", "maxrl_plain", "grpo", "grpo_sample_std", "rloo", "reinforce")


class Estimator(NamedTuple):
  """An estimator resolved with its parameters: hashable, a static argument under jit.

  Attributes:
    name: the registered name, or the function's name.
    advantage: a(reward, group_size, successes, **params), elementwise in jnp.
    params: its keyword parameters, sorted (name, value) pairs, defaults filled in.
    takes_eps: whether `advantage` takes the stabiliser `eps` as a keyword.
  """
  name: str
  advantage: Callable[..., jax.Array]
  params: tuple[tuple[str, Hashable], ...] = ()
  takes_eps: bool = False

  def __call__(self, reward, group_size, successes, eps) -> jax.Array:
    extra = {"eps": eps} if self.takes_eps else {}
    return self.advantage(reward, group_size, successes, **dict(self.params), **extra)

  # Equal and hashed with each parameter's type: jit keys its cache of static arguments by ==,
  # under which k=4.0 would reuse the program traced for k=4 and skip the checks of tracing.
  def _typed(self) -> tuple:
    return (self.name, self.advantage, tuple((key, type(value), value)
                                             for key, value in self.params), self.takes_eps)

  def __eq__(self, other) -> bool:
    return isinstance(other, Estimator) and self._typed() == other._typed()

  def __ne__(self, other) -> bool:
    return not self == other

  def __hash__(self) -> int:
    return hash(self._typed())

  def __str__(self) -> str:
    params = ", ".join(f"{key}={value!r}" for key, value in self.params)
    return f"{self.name}({params})" if params else self.name


class EstimatorEntry(NamedTuple):
  """A registered estimator and where its formula comes from.

  Attributes:
    name: the name it is registered under.
    advantage: a(reward, group_size, successes, **params).
    source: the paper, repository and file the formula is taken from.
    objectives: the objectives that source claims the estimator ascends, in the grammar of
      `resolve_objective` ("p", "log_p", "pass@k", "truncated@n-1", ...).
    formula: the advantage in words, for tables.
    scale: c(p, n) in closed form, where one is known ("" where only the sum is).
  """
  name: str
  advantage: Callable[..., jax.Array]
  source: str
  objectives: tuple[str, ...]
  formula: str
  scale: str


_REGISTRY: dict[str, EstimatorEntry] = {}
_EMPTY = inspect.Parameter.empty


@functools.cache
def _keywords(fn: Callable) -> tuple[dict[str, Any], bool, bool]:
  """({keyword parameter: default or _EMPTY}, takes eps, takes **kwargs) of an estimator."""
  try:
    parameters = list(inspect.signature(fn).parameters.values())
  except (TypeError, ValueError):
    raise TypeError(f"cannot read the signature of the estimator {fn!r}.") from None
  kind = inspect.Parameter
  positional = [p for p in parameters if p.kind in (kind.POSITIONAL_ONLY,
                                                    kind.POSITIONAL_OR_KEYWORD)]
  if len(positional) < 3 and not any(p.kind == kind.VAR_POSITIONAL for p in parameters):
    raise TypeError(f"an estimator is a function a(reward, group_size, successes, **params); "
                    f"{getattr(fn, '__name__', fn)!r} takes {len(positional)} positional "
                    "argument(s).")
  # Past (reward, group_size, successes): what a caller can pass by keyword.
  rest = ([p for p in positional[3:] if p.kind == kind.POSITIONAL_OR_KEYWORD]
          + [p for p in parameters if p.kind == kind.KEYWORD_ONLY])
  keywords = {p.name: p.default for p in rest if p.name != "eps"}
  takes_eps = any(p.name == "eps" for p in rest)
  return keywords, takes_eps, any(p.kind == kind.VAR_KEYWORD for p in parameters)


def _spec(name: str, fn: Callable, params: Mapping[str, Any]) -> Estimator:
  keywords, takes_eps, any_keyword = _keywords(fn)
  if "eps" in params:
    raise TypeError("eps is an argument of advantages / expected_scale / flat_advantages, "
                    "not an estimator parameter.")
  unknown = sorted(set(params) - set(keywords)) if not any_keyword else []
  if unknown:
    raise TypeError(f"estimator {name!r} has no parameter {unknown[0]!r}; its parameters: "
                    f"{', '.join(keywords) or 'none'}.")
  missing = [key for key, default in keywords.items() if default is _EMPTY and key not in params]
  if missing:
    raise TypeError(f"estimator {name!r} needs the keyword parameter(s) {', '.join(missing)}.")
  merged = {key: default for key, default in keywords.items() if default is not _EMPTY}
  # NumPy scalars as Python ones: np.int64(4) is the parameter k=4 (`Estimator._typed`).
  merged.update({key: value.item() if isinstance(value, np.generic) else value
                 for key, value in params.items()})
  for key, value in merged.items():
    try:
      hash(value)
    except TypeError:
      raise TypeError(f"estimator parameters are static (jit hashes them): {key} must be a "
                      f"hashable value such as a Python int; got {type(value).__name__}.") from None
  return Estimator(name, fn, tuple(sorted(merged.items())), takes_eps)


def estimator_spec(estimator: "str | Callable | Estimator", **params) -> Estimator:
  """Resolves a registered name or a function, with its keyword parameters, to an `Estimator`.

  Args:
    estimator: a registered name (`registered_estimators()`), a function
      a(reward, group_size, successes, **params) of jnp arrays (elementwise; group_size and
      successes are floats; a keyword `eps` receives the callers' `eps`), or an `Estimator`.
    **params: its keyword parameters (static: Python numbers, hashed by jit). A function
      defined anew on every call, or a new `functools.partial`, is a new static value and
      compiles anew: define it once, and pass parameters here.

  Returns:
    The `Estimator`; equal (and so one compiled program) for equal names, functions and
    parameters.
  """
  if isinstance(estimator, Estimator):
    if params:
      raise TypeError(f"{estimator} is resolved already; give its parameters once.")
    return estimator
  if isinstance(estimator, str):
    validation.choice("estimator", estimator, tuple(_REGISTRY))
    return _spec(estimator, _REGISTRY[estimator].advantage, params)
  if callable(estimator):
    return _spec(getattr(estimator, "__name__", type(estimator).__name__), estimator, params)
  raise TypeError(f"estimator must be a registered name or a function a(reward, group_size, "
                  f"successes); got {type(estimator).__name__}.")


# --- objectives -------------------------------------------------------------------------------

_ORDERED = re.compile(r"(?P<kind>pass|truncated)@(?P<order>[1-9]\d*|n-1|n|[A-Za-z_]\w*)")


def resolve_objective(objective: str, n: int, params: Mapping[str, Any] | None = None) -> str:
  """An objective with its order made a number, for a group of n and an estimator's parameters.

  The grammar: "p" (RL's expected reward), "log_p" (maximum likelihood), "pass@K" and
  "truncated@T", whose order is a number, "n" or "n-1" (the group size), or the name of an
  estimator parameter ("pass@k", "truncated@order"). So "truncated@n-1" at n = 8 is
  "truncated@7" and "pass@k" with k = 4 is "pass@4".

  Raises:
    ValueError: on anything else, or an order below 1 (a constant objective).
  """
  if objective in ("p", "log_p"):
    return objective
  match = _ORDERED.fullmatch(objective) if isinstance(objective, str) else None
  if match is None:
    raise ValueError(f"objective must be 'p', 'log_p', 'pass@K' or 'truncated@T' (K, T a "
                     f"number, n, n-1 or a parameter name); got {objective!r}.")
  order = match["order"]
  if order.isdigit():
    value = int(order)
  elif order in ("n", "n-1"):
    value = int(n) - (order == "n-1")
  elif params is not None and order in params:
    value = validation.integer(order, params[order])
  else:
    raise ValueError(f"objective {objective!r} names the parameter {order!r}, which the "
                     f"estimator's parameters {dict(params or {})} do not hold.")
  if value < 1:
    raise ValueError(f"objective {objective!r} has order {value} at n = {n}: a constant "
                     "objective, with nothing to ascend.")
  return f"{match['kind']}@{value}"


def objective_scale(objective: str, log_p: jax.Array) -> jax.Array:
  """The scale s_J(p) of an objective's gradient: grad J(p) = s_J(p) grad log p.

  An estimator is unbiased for J, up to a constant, exactly when its c(p, n) is a constant
  multiple of s_J(p) (docs/method.md#the-estimator-and-its-scale).

  * "log_p"  maximum likelihood: 1.
  * "p"      RL's expected reward: grad p = p grad log p, so p.
  * "pass@K" 1 - (1 - p)^K: K (1 - p)^(K - 1) p.
  * "truncated@T"  MaxRL's order-T objective, sum_{k=1..T} pass@k / k, the first T terms of
    log p = -sum_k (1 - p)^k / k up to a constant (`sera_jax.truncated_objective`); its
    derivative sum_{k=1..T} (1 - p)^(k - 1) = (1 - (1 - p)^T) / p gives 1 - (1 - p)^T,
    pass@T, which tends to 1 (log p) as T grows.

  Args:
    objective: as `resolve_objective` reads it, with a numeric order.
    log_p: log success probabilities, finite and <= 0.

  Returns:
    s_J(p) in the floating dtype of `log_p`, its shape.
  """
  name = resolve_objective(objective, 0)
  log_p = validation.log_probabilities("log_p", log_p)
  if name == "log_p":
    return jnp.ones_like(log_p)
  if name == "p":
    return jnp.exp(log_p)
  kind, order = name.split("@")
  order = int(order)
  log_q = log1mexp(log_p)
  if kind == "truncated":
    return -jnp.expm1(order * log_q)
  # order - 1 = 0 would meet log q = -inf at p = 1 as 0 * inf: pass@1 is p.
  return order * jnp.exp(log_p + (order - 1) * log_q) if order > 1 else jnp.exp(log_p)


# --- the registry -------------------------------------------------------------------------------

def register_estimator(name: str, fn: Callable, *, source: str, objectives: Sequence[str] = (),
                       formula: str = "", scale: str = "") -> Callable:
  """Registers an estimator under `name`, with where its formula comes from.

  Args:
    name: the name `advantages`, `expected_scale` and `flat_advantages` take.
    fn: a(reward, group_size, successes, **params), elementwise in jnp: reward 0 or 1,
      group_size n and successes K floats, broadcast against each other. It must hold for
      every n >= 1 and 0 <= K <= n (groups are ragged); n = 0 is masked to 0 for it. A
      keyword `eps` receives the callers' stabiliser; other keyword-only parameters are the
      estimator's parameters (static).
    source: the paper, repository and file the formula is taken from.
    objectives: the objectives the source claims it ascends, as `resolve_objective` reads
      them (placeholders allowed: "pass@k", "truncated@n-1"); () when the source states none.
    formula: the advantage in words.
    scale: c(p, n) in closed form, where one is known.

  Returns:
    `fn`, unchanged.

  Raises:
    ValueError: `name` is taken by another function, `source` is empty, or an objective does
      not parse or names a parameter `fn` does not take.
    TypeError: `name` or `source` is no string, `objectives` is one string, or `fn` does not
      take (reward, group_size, successes).
  """
  if not isinstance(name, str) or not name:
    raise TypeError(f"name must be a non-empty string; got {name!r}.")
  keywords, _, _ = _keywords(fn)
  if not isinstance(source, str):
    raise TypeError(f"source must be a string; got {source!r}.")
  if not source.strip():
    raise ValueError("source must say where the formula comes from (a paper, a repository "
                     "and a file).")
  if isinstance(objectives, str):
    raise TypeError(f"objectives must be a sequence of objectives, e.g. ({objectives!r},); got "
                    f"the string {objectives!r}.")
  objectives = tuple(objectives)
  for objective in objectives:
    resolve_objective(objective, 2, {key: 1 for key in keywords})
  existing = _REGISTRY.get(name)
  if existing is not None and existing.advantage is not fn:
    raise ValueError(f"estimator {name!r} is registered already, to "
                     f"{getattr(existing.advantage, '__qualname__', existing.advantage)}.")
  _REGISTRY[name] = EstimatorEntry(name, fn, source, objectives, formula, scale)
  return fn


def registered_estimators() -> Mapping[str, EstimatorEntry]:
  """Every registered estimator, name -> `EstimatorEntry`, in registration order (read-only)."""
  return types.MappingProxyType(_REGISTRY)


# --- the formulas ----------------------------------------------------------------------------


def _safe_divide(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
  """numerator / denominator, and 0 where the denominator is 0 (no NaN, even in grads)."""
  nonzero = denominator != 0
  return jnp.where(nonzero, numerator / jnp.where(nonzero, denominator, 1), 0)


def _mean(group_size, successes):
  return _safe_divide(successes, group_size)


def _maxrl(reward, group_size, successes, *, eps):
  # Centered MaxRL (docs/method.md#the-estimator-and-its-scale): (r - mu) / (mu + eps), silenced
  # when no rollout succeeded.
  mean = _mean(group_size, successes)
  return jnp.where(successes > 0, _safe_divide(reward - mean, mean + eps), 0)


def _maxrl_plain(reward, group_size, successes, *, eps):
  # Plain MaxRL: r / (mu + eps) = (1/K) r n at eps = 0, its scale is pass@n.
  return jnp.where(successes > 0, _safe_divide(reward, _mean(group_size, successes) + eps), 0)


def _grpo(reward, group_size, successes, *, eps):
  # Population std of 0/1 rewards is sqrt(mu (1 - mu)); exact for binary rewards.
  mean = _mean(group_size, successes)
  std = jnp.sqrt(jnp.maximum(mean * (1 - mean), 0))
  return _safe_divide(reward - mean, std + eps)


def _grpo_sample_std(reward, group_size, successes, *, eps):
  # Sample std (ddof = 1) of 0/1 rewards: sqrt(n mu (1 - mu) / (n - 1)), 0 for one rollout.
  mean = _mean(group_size, successes)
  std = jnp.sqrt(jnp.maximum(_safe_divide(group_size * mean * (1 - mean), group_size - 1), 0))
  return _safe_divide(reward - mean, std + eps)


def _rloo(reward, group_size, successes):
  # Leave-one-out baseline: the mean reward of the other n - 1 rollouts.
  return jnp.where(group_size >= 2, reward - _safe_divide(successes - reward, group_size - 1), 0)


def _reinforce(reward, group_size, successes):
  return reward - _mean(group_size, successes)


def _ratio_products(numerators: jax.Array, denominators: jax.Array) -> jax.Array:
  """prod_{i <= j} numerators_i / denominators_i for every j of the last axis.

  Ratios of binomial coefficients as products of ratios that stay in [0, 1], exact where
  C(a, b) / C(c, b) in gammaln would round: a factor with a numerator <= 0 is 0 (C(a, b) = 0
  for b > a), and so is 0 / 0.
  """
  return jnp.cumprod(_safe_divide(jnp.maximum(numerators, 0), denominators), axis=-1)


def _last_axis(*arrays) -> tuple[jax.Array, ...]:
  """Each array with a new trailing axis, along which a formula runs over k."""
  return tuple(jnp.asarray(a)[..., None] for a in arrays)


def _float_range(start: int, stop: int, like: jax.Array) -> jax.Array:
  return jnp.arange(start, stop, dtype=jnp.result_type(like, 1.0))


def _maclaurin(reward, group_size, successes, *, order):
  # Success weight 1/n; failure weight -(1/n) sum_{k=2..min(T,F)} C(F-1, k-1) / C(n-1, k-1),
  # F = n - K, the k-th ratio the product of (F - j) / (n - j) over j = 1..k-1.
  order = validation.integer("order", order, minimum=1)
  n, failures = _last_axis(group_size, group_size - successes)
  j = _float_range(1, order, n)
  ratios = _ratio_products(failures - j, n - j)  # k = j + 1 = 2..order; 0 for k > F
  failure = -_safe_divide(jnp.sum(ratios, axis=-1), group_size)
  return jnp.where(reward > 0, _safe_divide(1, group_size), failure)


def _maclaurin_baseline(reward, group_size, successes, *, order):
  # The k-th Maclaurin term with a leave-one-out baseline over the k-subsets, for
  # k = 2..min(T, n-1): rho_k = C(F, k) / (C(n, k) - 1) adds rho_k / n to a success and
  # rho_k (1/n - 1/F) to a failure; the k = n term (T >= n), with no other subset to
  # compare, keeps its plain weight -1/n on the failures of an all-failed group.
  order = validation.integer("order", order, minimum=1)
  failures = group_size - successes
  n, f = _last_axis(group_size, failures)
  i = _float_range(0, order, n)  # k = i + 1 = 1..order
  picked = _ratio_products(f - i, n - i)  # C(F, k) / C(n, k)
  inverse = _ratio_products(i + 1, n - i)  # 1 / C(n, k)
  in_range = (i + 1 >= 2) & (i + 1 <= n - 1)
  rho = jnp.sum(jnp.where(in_range, _safe_divide(picked, 1 - inverse), 0), axis=-1)
  all_failed = (order >= group_size) & (group_size >= 2) & (successes == 0)
  failure = (_safe_divide(rho, group_size) - _safe_divide(rho, failures)
             - jnp.where(all_failed, _safe_divide(1, group_size), 0))
  return jnp.where(reward > 0, _safe_divide(1 + rho, group_size), failure)


def _pkpo(reward, group_size, successes, *, k):
  # r C(F, k-1) / C(n-1, k-1) (F = n - K failures), then the leave-one-out
  # (n a_i - sum_j a_j) / (n - 1) for n > 1; the sum of the group's a_j is K times the
  # success value. The pass@k estimate needs n >= k: smaller groups get 0.
  k = validation.integer("k", k, minimum=1)
  n, failures = _last_axis(group_size, group_size - successes)
  i = _float_range(0, k - 1, n)
  share = jnp.prod(_safe_divide(jnp.maximum(failures - i, 0), n - 1 - i), axis=-1)
  raw = reward * share
  left_out = _safe_divide(group_size * raw - successes * share, group_size - 1)
  return jnp.where(group_size >= k, jnp.where(group_size > 1, left_out, raw), 0)


def _one_sided_grpo(reward, group_size, successes, *, eps):
  mean = _mean(group_size, successes)
  return _safe_divide(reward - mean, jnp.sqrt(mean) + eps)


def _clipped_pnorm(reward, group_size, successes):
  # The source gives a group of one rollout the mean 0 (so 8 r), and divides by the group
  # size it assumes all groups share; here each group's own n.
  mean = jnp.where(group_size > 1, _mean(group_size, successes), 0)
  return _safe_divide(reward - mean, jnp.maximum(mean, 0.125) * group_size)


def _maxrl_std(reward, group_size, successes, *, eps):
  # The repository's maxrl advantage, (r - mu) / (mu + eps), divided by the population std too.
  mean = _mean(group_size, successes)
  std = jnp.sqrt(jnp.maximum(mean * (1 - mean), 0))
  return _safe_divide(_safe_divide(reward - mean, std + eps), mean + eps)


_MAXRL_PAPER = "MaxRL, Tajwar et al. 2026, arXiv 2602.02710"
_MAXRL_REPO = "tajwarfahim/maxrl verl/trainer/ppo"

register_estimator(
    "maxrl", _maxrl, source=f"{_MAXRL_PAPER}; docs/method.md#the-estimator-and-its-scale",
    objectives=("truncated@n-1",), formula="(r - mu) / (mu + eps); 0 when K = 0",
    scale="1 - (1-p)^(n-1)")
register_estimator(
    "maxrl_plain", _maxrl_plain,
    source=f"{_MAXRL_PAPER}; docs/method.md#the-estimator-and-its-scale",
    objectives=("truncated@n",), formula="r / (mu + eps); 0 when K = 0", scale="1 - (1-p)^n")
register_estimator(
    "grpo", _grpo, source="GRPO, Shao et al. 2024, arXiv 2402.03300, with the population std "
    "as in the MaxRL paper", objectives=("p",),
    formula="(r - mu) / (sigma + eps), sigma = sqrt(mu (1-mu))")
register_estimator(
    "grpo_sample_std", _grpo_sample_std,
    source='google/tunix tunix/rl/algo_core.py compute_advantages ("grpo"); verl and TRL',
    objectives=("p",), formula="(r - mu) / (s + eps), s = sqrt(n mu (1-mu) / (n-1)); 0 at n = 1")
register_estimator(
    "rloo", _rloo, source="RLOO, Ahmadian et al. 2024, arXiv 2402.14740; google/tunix "
    "tunix/rl/algo_core.py compute_rloo_advantages", objectives=("p",),
    formula="r - (K - r) / (n - 1); 0 at n = 1", scale="p (n >= 2); 0 at n = 1")
register_estimator(
    "reinforce", _reinforce, source="REINFORCE, Williams 1992, with the group mean as baseline",
    objectives=("p",), formula="r - mu", scale="(1 - 1/n) p")
# Dr. GRPO's advantage is REINFORCE's with the mean baseline: one function, two sources.
register_estimator(
    "drgrpo", _reinforce, source="Dr. GRPO, Liu et al. 2025, arXiv 2503.20783; google/tunix "
    'tunix/rl/algo_core.py compute_drgrpo_advantages ("drgrpo")', objectives=("p",),
    formula="r - mu", scale="(1 - 1/n) p")
register_estimator(
    "maclaurin", _maclaurin, source=f"{_MAXRL_REPO}/maclaurin.py maclaurin_weights, "
    'core_algos.py "maclaurin" (T = truncate_order)', objectives=("truncated@order",),
    formula="success 1/n; failure -(1/n) sum_{k=2..min(T,F)} C(F-1,k-1) / C(n-1,k-1), "
    "F = n - K, T = order", scale="(1 - (1-p)^min(T,n)) / n")
register_estimator(
    "maclaurin_baseline", _maclaurin_baseline, source=f"{_MAXRL_REPO}/maclaurin.py "
    'maclaurin_weights_loo, core_algos.py "maclaurin_baseline" (T = truncate_order)',
    objectives=("truncated@order",),
    formula="success (1 + R) / n; failure R (1/n - 1/F) - [T >= n, F = n] / n, "
    "R = sum_{k=2..min(T,n-1)} C(F,k) / (C(n,k) - 1), T = order",
    scale="(p/n) [1 + sum_{k=2..min(T,n-1)} b_k (1-p)^(k-1) + [T >= n >= 2] (1-p)^(n-1)], "
    "b_k = C(n,k) (n-k) / (n (C(n,k) - 1))")
register_estimator(
    "pkpo", _pkpo, source=f"PKPO, Walder & Karkhanis 2025, arXiv 2505.15201, as {_MAXRL_REPO}/"
    "core_algos.py compute_pkpo_outcome_advantage has it (k = pass_k)", objectives=("pass@k",),
    formula="a = r C(F,k-1) / C(n-1,k-1), then (n a - sum a) / (n - 1); 0 for n < k",
    scale="p (1-p)^(k-2) [(1-p) + (k-1) p / (n-1)] for n >= max(k, 2); p at n = k = 1; "
    "0 for n < k")
register_estimator(
    "one_sided_grpo", _one_sided_grpo,
    source=f"{_MAXRL_REPO}/core_algos.py compute_one_sided_grpo_outcome_advantage",
    formula="(r - mu) / (sqrt(mu) + eps)")
register_estimator(
    "clipped_pnorm", _clipped_pnorm,
    source=f"{_MAXRL_REPO}/core_algos.py compute_clipped_pnorm_outcome_advantage",
    formula="(r - mu) / max(mu, 1/8) / n; mu = 0 at n = 1")
register_estimator(
    "maxrl_std", _maxrl_std,
    source=f'{_MAXRL_REPO}/core_algos.py compute_misc_outcome_advantage (advantage_type '
    '"p_normalization" at 7db6bb9)',
    formula="(r - mu) / (sigma + eps) / (mu + eps), sigma = sqrt(mu (1-mu))")


def rollout_advantage(estimator: "str | Callable | Estimator", reward, group_size, successes,
                      eps: float = 1e-6, **params) -> jax.Array:
  """Advantage of one rollout with reward r in a group of n with K successes.

  See docs/method.md#the-estimator-and-its-scale.

  The one formula behind `advantages` (padded groups), `expected_scale` (at r = 1
  and r = 0) and `sera_jax.method.flat.flat_advantages` (flat buffers); 0 when n = 0.
  Arguments broadcast; `estimator` and `params` as `estimator_spec` takes them.
  """
  value = estimator_spec(estimator, **params)(reward, group_size, successes, eps)
  return jnp.where(group_size > 0, value, 0)


def _group_advantages(rewards: jax.Array, mask: jax.Array, *, estimator: Estimator,
                      eps: float) -> jax.Array:
  """Advantages of one group: rewards [N] (0/1), mask [N] bool -> [N], 0 on masked slots."""
  chex.assert_rank([rewards, mask], 1)
  chex.assert_equal_shape([rewards, mask])
  valid = mask.astype(rewards.dtype)
  group_size = jnp.sum(valid)
  successes = jnp.sum(rewards * valid)
  value = rollout_advantage(estimator, rewards, group_size, successes, eps)
  return jnp.where(mask, value, 0)


def _float_array(x) -> jax.Array:
  arr = jnp.asarray(x)
  if not jnp.issubdtype(arr.dtype, jnp.floating):
    arr = arr.astype(jnp.result_type(float))
  return arr


def advantages(rewards: jax.Array, mask: jax.Array, *,
               estimator: "str | Callable | Estimator" = "maxrl", eps: float = 1e-6,
               **params) -> jax.Array:
  """Per-rollout advantages of M padded groups of binary rewards.

  See docs/method.md#the-estimator-and-its-scale.

  For group q, n = sum_j mask_qj, K = sum_j r_qj mask_qj and mu = K / n:

  * "maxrl"       (r - mu) / (mu + eps); 0 for the whole group when K = 0.
  * "maxrl_plain" r / (mu + eps); 0 when K = 0.
  * "grpo"        (r - mu) / (std + eps), std the population std sqrt(mu (1 - mu))
                    (the MaxRL paper's GRPO).
  * "grpo_sample_std"  (r - mu) / (std + eps), std the sample std (ddof = 1)
                    sqrt(n mu (1 - mu) / (n - 1)) (Tunix's, verl's and TRL's GRPO;
                    Tunix adds eps = 1e-6 too); a group of one gets 0 (r = mu), where
                    verl sets its std to 1 and gives r / (1 + eps).
  * "rloo"        r_j - (K - r_j) / (n - 1); 0 when n < 2.
  * "reinforce"   r - mu.

  and every other registered estimator (`registered_estimators()`: the peers' "drgrpo",
  "maclaurin", "pkpo", ..., each with its source), or a function a(r, n, K).

  Masked slots and groups with n = 0 get 0. Runs under `jax.jit` with
  `estimator` static; value checks run only on concrete inputs. It compiles once
  per padded width N: pad every step to one static width
  (`allocation.max_count(mode, baseline_n=N0, n_max=n_max)`), not to max(counts),
  which would compile anew whenever the largest group grows.

  Args:
    rewards: [M, N] rewards, each 0 or 1 (padded slots may hold either).
    mask: [M, N] boolean-like, True on real rollouts.
    estimator: a registered name, a function a(reward, group_size, successes), or an
      `Estimator` (`estimator_spec`).
    eps: the stabiliser in the denominators of "maxrl", "maxrl_plain" and both GRPOs (and
      of any estimator that takes `eps`).
    **params: the estimator's keyword parameters, e.g. k=4 for "pkpo" (static).

  Returns:
    [M, N] advantages in the floating dtype of `rewards` (float32 by default).
  """
  estimator = estimator_spec(estimator, **params)
  rewards = _float_array(validation.binary("rewards", rewards))
  mask = validation.mask("mask", mask)
  validation.rank("rewards", rewards, 2)
  validation.same_shape(("rewards", "mask"), rewards, mask)
  return _batched_advantages(rewards, mask, estimator=estimator, eps=eps)


@functools.partial(jax.jit, static_argnames="estimator")
def _batched_advantages(rewards, mask, *, estimator, eps):
  per_group = functools.partial(_group_advantages, estimator=estimator, eps=eps)
  return jax.vmap(per_group)(rewards, mask)


def _rollout_counts(n, dtype, max_n: int | None) -> tuple[jax.Array, int]:
  """Validates n (integers >= 0) and returns it as `dtype` with the static grid size."""
  n = jnp.asarray(n)
  if validation.is_concrete(n):
    values = np.asarray(n)
    bad = ~((values >= 0) & (values == np.round(values)))
    if bad.any():
      raise ValueError(f"n must hold integers >= 0; found {validation.first_bad(bad, values)}.")
  return n.astype(dtype), validation.static_width("n", n, "max_n", max_n)


def expected_scale(estimator: "str | Callable | Estimator", log_p: jax.Array, n: jax.Array, *,
                   eps: float = 1e-6, max_n: int | None = None, **params) -> jax.Array:
  """Exact scale c(p, n) with E[g] = c(p, n) grad log p for a group of n rollouts.

  docs/method.md#the-estimator-and-its-scale gives

      c(p, n) = (1/n) sum_{K=0..n} Binom(K; n, p) [K a_s(K) - (n - K) a_f(K) p / (1 - p)],

  with a_s(K), a_f(K) the advantages `advantages` gives a success and a
  failure in a group of n with K successes. The identities
  K Binom(K; n, p) = n p Binom(K - 1; n - 1, p) and
  (n - K) Binom(K; n, p) p / (1 - p) = n p Binom(K; n - 1, p) turn it, term by
  term and exactly, into

      c(p, n) = p * sum_{k=0..n-1} Binom(k; n - 1, p) [a_s(k + 1) - a_f(k)],

  which never forms p / (1 - p) (finite at p -> 1, no cancellation of huge
  terms) and is what is summed here, with the binomial pmf in log space.
  At eps = 0 it equals kappa (maxrl), coverage (maxrl_plain), (1 - 1/n) p
  (reinforce) and p (rloo, n >= 2); it is exact for any eps.

  Args:
    estimator: as in `advantages`.
    log_p: log success probabilities, finite and <= 0.
    n: rollout counts (integers >= 0), broadcastable against `log_p`; n = 0 gives 0.
    eps: as in `advantages`.
    max_n: static upper bound on n (the size of the K grid); a concrete n above
      it raises. Defaults to max(n) when n is concrete, which compiles anew for
      every new max(n): training loops should pass one static bound
      (`allocation.max_count(mode, baseline_n=N0, n_max=n_max)`). Required under
      `jax.jit`, where n above max_n cannot be detected and would truncate the sum.
    **params: the estimator's keyword parameters, as in `advantages`.

  In float32 the result is accurate to about 1e-4 relative for n in the
  hundreds (rounding of gammaln); in float64 to about 1e-12.

  Returns:
    c(p, n) with the broadcast shape of `log_p` and `n`, in the dtype of `log_p`
    (float32 for 16-bit `log_p`).
  """
  estimator = estimator_spec(estimator, **params)
  log_p = validation.log_probabilities("log_p", log_p)
  n, max_n = _rollout_counts(n, log_p.dtype, max_n)
  return _expected_scale(log_p, n, estimator=estimator, eps=eps, max_n=max_n)


@functools.partial(jax.jit, static_argnames=("estimator", "max_n"))
def _expected_scale(log_p, n, *, estimator, eps, max_n):
  log_p, n = jnp.broadcast_arrays(log_p, n)
  others = jnp.maximum(n - 1, 0)[..., None]  # the n - 1 rollouts besides the one scored
  k = jnp.arange(max_n, dtype=log_p.dtype)  # successes among them: 0..max_n - 1
  in_range = k <= others
  failures = jnp.where(in_range, others - k, 0)
  log_p_ = log_p[..., None]
  # k log p + (others - k) log(1 - p) with 0 * log 0 = 0 so that p = 1 stays finite.
  log_powers = k * log_p_ + jnp.where(failures > 0, failures * log1mexp(log_p_), 0)
  log_choose = gammaln(others + 1) - gammaln(k + 1) - gammaln(failures + 1)
  pmf = jnp.where(in_range, jnp.exp(log_choose + log_powers), 0)
  # The pmf sums to 1 exactly; renormalising removes the rounding shared by every term
  # (gammaln(n) is ~n log n large), which is most of the float error at n in the hundreds.
  pmf = _safe_divide(pmf, jnp.sum(pmf, axis=-1, keepdims=True))
  group_size = n[..., None]
  a_success = rollout_advantage(estimator, jnp.ones((), k.dtype), group_size, k + 1, eps)
  a_failure = rollout_advantage(estimator, jnp.zeros((), k.dtype), group_size, k, eps)
  # Past k = n - 1 the pmf is 0, but an estimator owes nothing finite at K > n.
  gain = jnp.where(in_range, a_success - a_failure, 0)
  scale = jnp.exp(log_p) * jnp.sum(pmf * gain, axis=-1)
  return jnp.where(n > 0, scale, 0)


def policy_loss(log_probs: jax.Array, advantages: jax.Array, mask: jax.Array,
                weights: jax.Array, baseline_n: int) -> jax.Array:
  """Surrogate loss of docs/method.md#weights-and-the-loss (descent convention).

      loss = -(1 / (M N0)) sum_q w_q sum_j mask_qj * stop_gradient(A_qj) * log pi(z_qj | x_q)

  so d loss / d log_probs_qj = -(w_q / (M N0)) A_qj mask_qj. Padded slots
  contribute nothing (not even NaN from garbage log-probabilities there).

  Args:
    log_probs: [M, N] log pi(z_qj | x_q) of each rollout (differentiable).
    advantages: [M, N] advantages (gradient stopped).
    mask: [M, N] boolean-like, True on real rollouts.
    weights: [M] prompt weights w_q (e.g. `Allocation.weights`, N0 / n_q).
    baseline_n: N0, the per-prompt baseline of the budget M * N0.

  Returns:
    The scalar loss, in the dtype of `log_probs`.
  """
  baseline_n = validation.integer("baseline_n", baseline_n, minimum=1)
  mask = validation.mask("mask", mask)
  validation.rank("log_probs", log_probs, 2)
  validation.same_shape(("log_probs", "advantages", "mask"), log_probs, advantages, mask)
  validation.rank("weights", weights, 1)
  if jnp.shape(weights)[0] != jnp.shape(log_probs)[0]:
    raise ValueError(
        f"weights must have shape [M] = [{jnp.shape(log_probs)[0]}] to match log_probs "
        f"{tuple(jnp.shape(log_probs))}; got {tuple(jnp.shape(weights))}.")
  num_prompts = jnp.shape(log_probs)[0]
  per_rollout = jnp.where(mask, jax.lax.stop_gradient(advantages) * log_probs, 0)
  per_prompt = jnp.sum(per_rollout, axis=1)
  return -jnp.sum(weights * per_prompt) / (num_prompts * baseline_n)
