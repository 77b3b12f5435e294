"""Every allocation mode behind one config and one call: SERA's modes and the baselines.

* `AllocationConfig`: the typed, validated allocation of one experiment (its mode, the
  budget bounds, SERA's options, the advantage estimator the weights go with, and the
  historical estimator of docs/method.md#estimating-p). Every default is defined once,
  here or in `success`.
* `AllocationInputs`: what a setting knows of a batch of M prompts. Every mode reads
  log p; a baseline may read more (gvm the gradient norms, adaptive the rollouts'
  outcomes), and a setting leaves None what it cannot provide.
* `ALLOCATORS`: mode name -> `Allocator`, one signature for all:
  (AllocationConfig, AllocationInputs) -> `Allocation`.
* `allocate_with(config, inputs)`: the allocation of `config.mode`.
* `SCALARS`: the config's fields that fix no shape and no program. Inside a jitted step
  they may hold traced arrays (`config.replace(threshold=...)`), so that a batch of runs
  (`sera_jax.common.batching`) gives each run its own under one compiled step.

A setting states once what it can feed (`require`), so a mode it cannot run is refused
when its config is checked, with what is missing and what it can run instead.
"""

import dataclasses
import types
from collections.abc import Callable, Collection, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from sera_jax.method import allocation, allocators, estimators, success, validation
from sera_jax.method.allocation import Allocation

ROUND_SIZE = 2  # adaptive sampling's rollouts per open prompt and round


class AllocationInputs(NamedTuple):
  """What the allocation of a batch of M prompts reads; None where a setting has nothing.

  Attributes:
    log_p: [M] log p, exact or an estimate (every mode reads it).
    grad_norm: [M] each prompt's gradient norm ||grad log p_q|| (gvm).
    outcomes: bool [M, W >= n_max], slot j of prompt q the success of its j-th rollout,
      the very rollouts the gradient then uses (adaptive).
  """
  log_p: jax.Array | None = None
  grad_norm: jax.Array | None = None
  outcomes: jax.Array | None = None


# What each input is, for the message that refuses a mode a setting cannot feed.
_MEANINGS = types.MappingProxyType({
    "log_p": "log p of every prompt",
    "grad_norm": "each prompt's gradient norm ||grad log p_q||",
    "outcomes": "the successes of the rollouts, slot by slot, before the counts are fixed",
})


@dataclasses.dataclass(frozen=True, kw_only=True)
class AllocationConfig:
  """The allocation of an experiment, checked when it is built (hashable: a static jit argument).

  Inside a traced function the `SCALARS` fields may hold traced arrays (a run's own values
  in a batch of runs); they are checked where they are concrete, and such a config is not
  hashable.

  Attributes:
    mode: a registered mode (`MODES`): "uniform", "equalized", "sera" (`sera_jax.allocate`)
      or a baseline, "knapsack", "gvm", "adaptive" (`sera_jax.method.allocators`).
    baseline_n: N0, the mean rollouts a prompt; the budget of M prompts is M * N0.
    n_min, n_max: the fewest rollouts of a prompt with rollouts and the most of any,
      1 <= n_min <= baseline_n <= n_max.
    threshold: SERA's active-set threshold in [0, 1] (docs/method.md#the-active-set).
    normalize_by_rollout_count, normalize_by_rho: SERA's weights
      (docs/method.md#weights-and-the-loss); the baselines' weights are always N0 / n_q.
    round_size: adaptive sampling's rollouts per open prompt and round (>= 1).
    estimator: the advantage estimator the weights go with: a registered name
      (`sera_jax.method.estimators.registered_estimators()`).
    estimator_kwargs: its keyword parameters (a mapping, e.g. {"k": 4} for "pkpo"), held as
      sorted (name, value) pairs so that the config stays hashable.
    discount, alpha0, beta0: the historical estimator (docs/method.md#estimating-p):
      discount in [0, 1], the Beta prior's alpha0, beta0 > 0.
  """
  mode: str = "sera"
  baseline_n: int
  n_min: int = 2
  n_max: int
  threshold: float = 0.05
  normalize_by_rollout_count: bool = True
  normalize_by_rho: bool = False
  round_size: int = ROUND_SIZE
  estimator: str = "maxrl"
  estimator_kwargs: Mapping[str, Any] | tuple[tuple[str, Any], ...] = ()
  discount: float = success.DISCOUNT
  alpha0: float = success.ALPHA0
  beta0: float = success.BETA0

  def __post_init__(self):
    check_mode(self.mode)
    validation.budget_bounds(self.baseline_n, self.n_min, self.n_max)
    checked = {
        "baseline_n": validation.integer("baseline_n", self.baseline_n, minimum=1),
        "n_min": validation.integer("n_min", self.n_min, minimum=1),
        "n_max": validation.integer("n_max", self.n_max, minimum=1),
        "normalize_by_rollout_count": validation.boolean("normalize_by_rollout_count",
                                                         self.normalize_by_rollout_count),
        "normalize_by_rho": validation.boolean("normalize_by_rho", self.normalize_by_rho),
        "round_size": validation.integer("round_size", self.round_size, minimum=1),
        "estimator": validation.choice("estimator", self.estimator,
                                       tuple(estimators.registered_estimators())),
        "estimator_kwargs": _keyword_pairs("estimator_kwargs", self.estimator_kwargs),
    }
    for name, check in _SCALAR_CHECKS.items():
      value = getattr(self, name)
      if validation.is_concrete(value):
        checked[name] = check(name, value)
    for name, value in checked.items():  # plain Python values: equal configs hash alike
      object.__setattr__(self, name, value)
    _estimator_spec(self.estimator, self.estimator_kwargs)  # refuses parameters it lacks

  @property
  def estimator_spec(self) -> estimators.Estimator:
    """The estimator with its parameters, as `advantages` and `expected_scale` take it."""
    return _estimator_spec(self.estimator, self.estimator_kwargs)

  @classmethod
  def from_fields(cls, source: Mapping[str, Any], *, prefix: str = "",
                  **overrides) -> "AllocationConfig":
    """The config of the keys of `source` named as the fields (an experiment's ConfigDict).

    Fields absent from `source` keep their defaults; `overrides` (e.g. the mode) win.
    Messages name a bad value `prefix` + field, e.g. "config.threshold".
    """
    names = [field.name for field in dataclasses.fields(cls)]
    values = {name: source[name] for name in names if name in source} | overrides
    try:
      return cls(**values)
    except (TypeError, ValueError) as error:
      raise type(error)(f"{prefix}{error}") from None

  def replace(self, **changes) -> "AllocationConfig":
    """A copy with `changes`, checked again."""
    return dataclasses.replace(self, **changes)

  @property
  def max_count(self) -> int:
    """The most rollouts the mode gives one prompt: the static width of its rollout arrays."""
    return allocation.max_count(self.mode, baseline_n=self.baseline_n, n_max=self.n_max)


def _unit_interval(name: str, value: Any) -> float:
  validation.real(name, value)
  return validation.in_unit_interval(name, value)


def _positive(name: str, value: Any) -> float:
  return validation.real(name, value, positive=True)


# The fields that may be traced, with their checks: numbers the allocation and the historical
# estimator compute with, never branch or shape on.
_SCALAR_CHECKS = types.MappingProxyType({"threshold": _unit_interval, "discount": _unit_interval,
                                         "alpha0": _positive, "beta0": _positive})
SCALARS = tuple(_SCALAR_CHECKS)


def _estimator_spec(name: str, kwargs: tuple[tuple[str, Any], ...]) -> estimators.Estimator:
  try:
    return estimators.estimator_spec(name, **dict(kwargs))
  except TypeError as error:
    raise TypeError(f"estimator_kwargs: {error}") from None


def _keyword_pairs(name: str, value: Any) -> tuple[tuple[str, Any], ...]:
  """A mapping (a dict, a ConfigDict) or (key, value) pairs as sorted pairs of plain values."""
  items = value.items() if hasattr(value, "items") else value
  try:
    pairs = [(key, value) for key, value in items]
  except (TypeError, ValueError):
    raise TypeError(f"{name} must be a mapping of keyword parameters; got {value!r}.") from None
  return tuple(sorted((key, _plain(item)) for key, item in pairs))


def _plain(value: Any) -> Any:
  """A NumPy scalar as its Python value (hashed and compared as the Python value is)."""
  return value.item() if isinstance(value, np.generic) else value


class Allocator(NamedTuple):
  """One registered mode.

  Attributes:
    allocate: (AllocationConfig, AllocationInputs) -> `Allocation`; jittable, with the
      config static.
    needs: the `AllocationInputs` fields it reads.
  """
  allocate: Callable[[AllocationConfig, AllocationInputs], Allocation]
  needs: tuple[str, ...]

  @property
  def outcome_dependent(self) -> bool:
    """Its counts are drawn with the rollouts: its expected gradient has no closed form."""
    return "outcomes" in self.needs


def _bounds(config: AllocationConfig) -> dict[str, int]:
  return dict(baseline_n=config.baseline_n, n_min=config.n_min, n_max=config.n_max)


def _waterline(config: AllocationConfig, inputs: AllocationInputs) -> Allocation:
  return allocation.allocate(
      inputs.log_p, mode=config.mode, threshold=config.threshold,
      normalize_by_rollout_count=config.normalize_by_rollout_count,
      normalize_by_rho=config.normalize_by_rho, **_bounds(config))


def _knapsack(config: AllocationConfig, inputs: AllocationInputs) -> Allocation:
  return allocators.knapsack(inputs.log_p, **_bounds(config))


def _gvm(config: AllocationConfig, inputs: AllocationInputs) -> Allocation:
  return allocators.gvm(inputs.log_p, inputs.grad_norm, **_bounds(config))


def _adaptive(config: AllocationConfig, inputs: AllocationInputs) -> Allocation:
  return allocators.adaptive(inputs.outcomes, inputs.log_p, round_size=config.round_size,
                             **_bounds(config))


ALLOCATORS: Mapping[str, Allocator] = types.MappingProxyType({
    **{mode: Allocator(_waterline, ("log_p",)) for mode in allocation.MODES},
    "knapsack": Allocator(_knapsack, ("log_p",)),
    "gvm": Allocator(_gvm, ("log_p", "grad_norm")),
    "adaptive": Allocator(_adaptive, ("log_p", "outcomes")),
})
MODES = tuple(ALLOCATORS)


def check_mode(mode: Any, *, name: str = "mode") -> str:
  """Checks `mode` is registered; `name` is how the message calls it."""
  return validation.choice(name, mode, MODES)


def modes_fed_by(available: Collection[str]) -> tuple[str, ...]:
  """The modes whose every input is among `available` (`AllocationInputs` field names)."""
  return tuple(mode for mode, allocator in ALLOCATORS.items()
               if set(allocator.needs) <= set(available))


def require(mode: str, available: Collection[str], *, who: str) -> None:
  """Refuses a mode that needs an input `who` (e.g. "the maze") cannot provide.

  Raises:
    ValueError: naming the missing inputs and the modes `who` can run.
  """
  missing = [need for need in ALLOCATORS[check_mode(mode)].needs if need not in available]
  if missing:
    listing = "; ".join(f"{need} ({_MEANINGS[need]})" for need in missing)
    runnable = ", ".join(map(repr, modes_fed_by(available)))
    raise ValueError(f"allocation mode {mode!r} needs {listing}, which {who} cannot provide; "
                     f"{who} can run {runnable}.")


def allocate_with(config: AllocationConfig, inputs: AllocationInputs) -> Allocation:
  """The `Allocation` of `config.mode` on `inputs` (none of them is differentiated).

  Raises:
    ValueError: `inputs` lack what the mode reads.
  """
  present = [name for name, value in inputs._asdict().items() if value is not None]
  require(config.mode, present, who="these inputs")
  inputs = jax.tree.map(jax.lax.stop_gradient, inputs)
  return ALLOCATORS[config.mode].allocate(config, inputs)
