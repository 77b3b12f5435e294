"""Sortable keys of floats and stable-sort prefixes without an argsort.

The allocators rank prompts by float keys (docs/method.md#integer-rounding,
docs/method.md#the-active-set): the keys become ordered ints, and the first `count`
entries of a stable argsort are found from the sorted keys alone.
"""

import jax
import jax.numpy as jnp


def ordered_int(x: jax.Array) -> jax.Array:
  """Monotone map of floats to signed ints of the same width (float order = int order).

  XLA sorts one integer operand several times faster than floats or
  (value, index) pairs, and consecutive ints are consecutive floats.
  """
  int_type = jnp.int64 if x.dtype == jnp.float64 else jnp.int32
  bits = jax.lax.bitcast_convert_type(x, int_type)
  magnitude = bits & jnp.iinfo(int_type).max
  return jnp.where(bits < 0, -magnitude, bits)


def from_ordered_int(key: jax.Array, dtype) -> jax.Array:
  """Inverse of `ordered_int` (0 maps to +0.0)."""
  bits = jnp.where(key < 0, (-key) | jnp.iinfo(key.dtype).min, key)
  return jax.lax.bitcast_convert_type(bits, dtype)


def first_smallest(keys: jax.Array, sorted_keys: jax.Array, count: jax.Array) -> jax.Array:
  """Mask of the `count` smallest keys, ties to the smaller index.

  The same set as the first `count` entries of a stable argsort, from the
  sorted keys alone: everything below the count-th smallest key, then that
  key's ties in index order (a running count, needed only when the ties do
  not all fit).
  """
  last = sorted_keys[jnp.clip(count - 1, 0, keys.shape[0] - 1)]
  below = keys < last
  tie = keys == last
  room = count - jnp.sum(below.astype(jnp.int32))
  ties_fit = jnp.sum(tie.astype(jnp.int32)) <= room
  tie_taken = jax.lax.cond(ties_fit, lambda: tie,
                           lambda: tie & (jnp.cumsum(tie.astype(jnp.int32)) <= room))
  return (count > 0) & (below | tie_taken)


def all_among_first(keys: jax.Array, members: jax.Array, count: jax.Array) -> jax.Array:
  """Whether every member is among the `count` smallest keys (ties to the smaller index).

  The same answer as testing `first_smallest(keys, sort(keys), count)` on
  the members, without a sort: only the last member in (key, index) order
  matters, and its position is the number of entries before it.
  """
  index = jnp.arange(keys.shape[0])
  last_key = jnp.max(jnp.where(members, keys, jnp.iinfo(keys.dtype).min))
  last_index = jnp.max(jnp.where(members & (keys == last_key), index, -1))
  before = (keys < last_key) | ((keys == last_key) & (index < last_index))
  return ~jnp.any(members) | (jnp.sum(before.astype(jnp.int32)) < count)
