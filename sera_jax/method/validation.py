"""Eager argument checks shared by the public API.

Every public function validates its inputs at the boundary with a message that
names the argument, the offending value and what is allowed. Checks on values
run only when the value is concrete; under `jax.jit` only shapes and dtypes
are checked (values are tracers), so jitted callers validate once outside.
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_concrete(x: Any) -> bool:
  """True when `x` holds values (not a tracer inside jit/vmap/grad)."""
  return not isinstance(x, jax.core.Tracer)


def first_bad(bad: np.ndarray, values: np.ndarray) -> str:
  """The first value where `bad` holds, and its index, for an error message."""
  index = np.argwhere(bad)[0]
  where = tuple(int(i) for i in index) if values.ndim else ()
  return f"{values[tuple(index)]!r} at index {where}" if values.ndim else repr(values)


def log_probabilities(name: str, x: Any) -> jax.Array:
  """Returns `x` as a float array after checking it holds log probabilities.

  Allowed: finite values <= 0. Rejected: NaN, positive values, and -inf
  (p = 0, for which no allocation or estimator is defined). Integers and 16-bit
  floats (bfloat16 logits on a TPU give bfloat16 log p) are promoted to float32 at
  least: the method's log-space numerics and integer rounding need its precision.
  """
  arr = jnp.asarray(x)
  if not jnp.issubdtype(arr.dtype, jnp.floating):
    arr = arr.astype(jnp.result_type(float))
  arr = arr.astype(jnp.promote_types(arr.dtype, jnp.float32))
  if is_concrete(arr):
    values = np.asarray(arr)
    for bad, what in (
        (np.isnan(values), "NaN"),
        (values > 0, "a positive log-probability (p > 1)"),
        (np.isneginf(values), "-inf (p = 0)"),
    ):
      if bad.any():
        raise ValueError(
            f"{name} must hold finite log-probabilities <= 0; found {what}: "
            f"{first_bad(bad, values)}.")
  return arr


def binary(name: str, x: Any) -> jax.Array:
  """Returns `x` as a float array after checking every entry is 0 or 1."""
  arr = jnp.asarray(x)
  if is_concrete(arr):
    values = np.asarray(arr)
    bad = ~((values == 0) | (values == 1))
    if bad.any():
      raise ValueError(
          f"{name} must be binary (0 or 1); found {first_bad(bad, values)}.")
  return arr.astype(jnp.result_type(float)) if arr.dtype == jnp.bool_ else arr


def mask(name: str, x: Any) -> jax.Array:
  """Returns `x` as a bool array; accepts bools or numbers that are all 0/1."""
  arr = jnp.asarray(x)
  if arr.dtype != jnp.bool_:
    if is_concrete(arr):
      values = np.asarray(arr)
      bad = ~((values == 0) | (values == 1))
      if bad.any():
        raise ValueError(
            f"{name} must be boolean-like (bool, or numbers that are all 0/1); "
            f"found {first_bad(bad, values)}.")
    arr = arr != 0
  return arr


def integer(name: str, value: Any, *, minimum: int | None = None) -> int:
  """Returns `value` as a Python int, checking type and lower bound."""
  if isinstance(value, bool) or not isinstance(value, int | np.integer):
    raise TypeError(f"{name} must be an int; got {value!r} ({type(value).__name__}).")
  value = int(value)
  if minimum is not None and value < minimum:
    raise ValueError(f"{name} must be >= {minimum}; got {value}.")
  return value


def budget_bounds(baseline_n: Any, n_min: Any, n_max: Any) -> None:
  """Checks 1 <= n_min <= baseline_n <= n_max (skipped when a value is traced).

  Without them no allocation spends the budget M * baseline_n with n_min <= n_q <= n_max.
  """
  if not all(map(is_concrete, (baseline_n, n_min, n_max))):
    return
  n_min = integer("n_min", n_min, minimum=1)
  baseline_n = integer("baseline_n", baseline_n, minimum=1)
  n_max = integer("n_max", n_max, minimum=1)
  if n_min > baseline_n:
    raise ValueError(
        f"n_min must be <= baseline_n, else the budget M * baseline_n cannot give every "
        f"active prompt n_min rollouts; got n_min={n_min}, baseline_n={baseline_n}.")
  if baseline_n > n_max:
    raise ValueError(
        f"baseline_n must be <= n_max, else the budget M * baseline_n cannot be spent with "
        f"at most n_max rollouts a prompt; got baseline_n={baseline_n}, n_max={n_max}.")


def real(name: str, value: Any, *, minimum: float | None = None, positive: bool = False,
         below: float | None = None) -> float:
  """Returns `value` as a float, checking it is a finite number in the allowed range.

  Args:
    name: the argument's name in the message.
    value: the value.
    minimum: the least allowed value, if any.
    positive: require value > 0.
    below: an exclusive upper bound, if any.
  """
  if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
    raise TypeError(f"{name} must be a number; got {value!r} ({type(value).__name__}).")
  value = float(value)
  if not np.isfinite(value):
    raise ValueError(f"{name} must be finite; got {value}.")
  if positive and value <= 0:
    raise ValueError(f"{name} must be > 0; got {value}.")
  if minimum is not None and value < minimum:
    raise ValueError(f"{name} must be >= {minimum}; got {value}.")
  if below is not None and value >= below:
    raise ValueError(f"{name} must be < {below}; got {value}.")
  return value


def boolean(name: str, value: Any) -> bool:
  """Returns `value` as a bool, refusing anything but True and False (a string "False" is
  truthy)."""
  if not isinstance(value, bool | np.bool_):
    raise TypeError(f"{name} must be True or False; got {value!r} ({type(value).__name__}).")
  return bool(value)


def choice(name: str, value: Any, allowed: Sequence[str]) -> str:
  """Checks `value` is one of `allowed`."""
  if value not in allowed:
    raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}.")
  return value


def in_unit_interval(name: str, value: Any) -> float:
  """Checks a scalar hyper-parameter lies in [0, 1]."""
  not_a_number = TypeError(f"{name} must be a number in [0, 1]; got {value!r}.")
  if isinstance(value, str | bytes | bool):  # float() would take "0.1" and True
    raise not_a_number
  try:
    value = float(value)
  except (TypeError, ValueError):
    raise not_a_number from None
  if not 0.0 <= value <= 1.0:
    raise ValueError(f"{name} must lie in [0, 1]; got {value}.")
  return value


def same_shape(names: Sequence[str], *arrays: Any) -> None:
  """Checks all arrays share one shape."""
  shapes = [tuple(jnp.shape(a)) for a in arrays]
  if len(set(shapes)) > 1:
    listing = ", ".join(f"{n} {s}" for n, s in zip(names, shapes, strict=True))
    raise ValueError(f"shape mismatch: {listing}; they must have the same shape.")


def rank(name: str, x: Any, expected: int) -> None:
  """Checks the number of dimensions of `x`."""
  if jnp.ndim(x) != expected:
    raise ValueError(
        f"{name} must have rank {expected}; got shape {tuple(jnp.shape(x))}.")


def static_width(counts_name: str, counts: Any, width_name: str, width: int | None, *,
                 minimum: int = 0) -> int:
  """The static padded width of groups of `counts` rollouts: `width`, or max(counts).

  A width given with concrete counts must hold every group: a narrower one would
  silently drop rollouts. Without a width the counts must be concrete (outside jit),
  since a traced max cannot fix a shape; each new max then traces callers anew.

  Raises:
    ValueError: width < max(counts), or no width for traced counts.
  """
  if width is not None:
    width = integer(width_name, width, minimum=minimum)
  if not is_concrete(counts):
    if width is None:
      raise ValueError(f"{width_name} is required when {counts_name} is traced (inside jit): "
                       f"give a static int.")
    return width
  values = np.asarray(counts)
  largest = int(values.max()) if values.size else 0
  if width is None:
    return max(largest, minimum)
  if largest > width:
    raise ValueError(f"{width_name} = {width} is smaller than max({counts_name}) = {largest}: "
                     f"the groups would be truncated; give {width_name} >= {largest}.")
  return width


def indices(name: str, ids: jax.Array, size: int, rows_of=None) -> None:
  """Checks integer ids and, when they are concrete, that they lie in [0, size).

  Under `jax.jit` an id outside [0, size) cannot be detected: JAX's scatter and
  segment sums drop it.

  With `rows_of` = (name, array), the ids must also be rank 1 with one per row of the array.
  """
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array; got dtype {ids.dtype}.")
  if rows_of is not None:
    other, array = rows_of
    rank(name, ids, 1)
    if ids.shape[0] != jnp.shape(array)[0]:
      raise ValueError(
          f"{name} must have shape [M] = [{jnp.shape(array)[0]}] to match {other} "
          f"{tuple(jnp.shape(array))}; got {ids.shape}.")
  if is_concrete(ids):
    values = np.asarray(ids)
    bad = (values < 0) | (values >= size)
    if bad.any():
      raise ValueError(
          f"{name} must lie in [0, {size}); found {values[bad][0].item()!r}.")
