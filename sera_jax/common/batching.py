"""What every batch of runs shares: which configs may batch, the run axis and its mesh.

A batch trains R runs of one setting as one program: every array of the state gains a
leading run axis and the setting's step is mapped over it with `jax.vmap` (or, on the CPU and
where a setting asks for it, looped over it inside the program: `vmap_runs`, or for parts of
the step, `sliced_on_cpu`). The runs
share every config value that fixes a shape or the compiled program and differ only in
a setting's `varied` keys (the seed, scalars that enter the step as traced arrays: the
optimizer's, held in its state, and the allocation's `registry.SCALARS`, given to the step
by `allocation_scalars`).

On a mesh with a "runs" axis (`runs_mesh`) the run axis is split over its devices, so a
pod trains its grid as one program with each run's data on its own devices; the mesh's
"data" axis splits each run's batch as a single run's mesh does
(`sera_jax.common.sharding`). `vmap(..., spmd_axis_name=RUNS_AXIS)` puts the run axis on
"runs" in every sharding constraint inside the step.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sera_jax.common import sharding
from sera_jax.method import registry

RUNS_AXIS = "runs"


def flat_config(config: ml_collections.ConfigDict, prefix: str = "") -> dict[str, Any]:
  """{"key": value, "nested.key": value, ...} of every leaf of `config`."""
  flat = {}
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      flat |= flat_config(value, f"{prefix}{key}.")
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def check_batchable(configs: Sequence[ml_collections.ConfigDict], varied: Sequence[str]) -> None:
  """Refuses an empty batch, or runs that differ in a key outside `varied`.

  Raises:
    ValueError: naming the first such key and the two values.
  """
  if not configs:
    raise ValueError("a batch of runs needs at least one config.")
  first = flat_config(configs[0])
  for r, config in enumerate(configs[1:], start=1):
    other = flat_config(config)
    for key in sorted(first.keys() | other.keys()):
      if key not in varied and first.get(key) != other.get(key):
        raise ValueError(
            f"config.{key} differs between runs ({first.get(key)!r} in run 0, "
            f"{other.get(key)!r} in run {r}); the runs of a batch may differ only in "
            f"{', '.join(varied)}.")


def cond_any(needed: jax.Array, compute: Callable, fallback: Callable, *operands: Any) -> Any:
  """`compute(*operands)` when any entry of `needed` holds, else `fallback(*operands)`.

  For a costly branch that is rarely needed: `fallback` must agree with `compute`
  wherever the caller reads the result when no entry of `needed` holds. Under
  `jax.vmap` a `lax.cond` on a mapped predicate becomes a select that computes both
  branches for every mapped slice; here the predicate is reduced over the mapped axis
  as well, so a batch of runs computes `compute` (for all of them) only when some run
  needs it, as a run alone does. Nested vmaps reduce over every mapped axis.
  """

  @jax.custom_batching.custom_vmap
  def branch(needed, *operands):
    return jax.lax.cond(jnp.any(needed), compute, fallback, *operands)

  @branch.def_vmap
  def mapped_branch(axis_size, in_batched, needed, *operands):
    _, *operands_batched = in_batched  # `needed` is reduced whether or not it is mapped
    in_axes = jax.tree.map(lambda batched: 0 if batched else None, tuple(operands_batched))
    out = cond_any(needed, jax.vmap(compute, in_axes=in_axes, axis_size=axis_size),
                   jax.vmap(fallback, in_axes=in_axes, axis_size=axis_size), *operands)
    return out, jax.tree.map(lambda _: True, out)

  return branch(needed, *operands)


def _slice_args(args: Sequence[Any], in_axes: Sequence[Any], i) -> tuple:
  """Slice `i` (an int or a traced index) of the arguments of a vmap over `in_axes` (axis 0
  or None, each entry a prefix of its argument's pytree)."""
  return jax.tree.map(
      lambda axis, arg: arg if axis is None else jax.tree.map(lambda x: x[i], arg),
      tuple(in_axes), tuple(args), is_leaf=lambda axis: axis is None)


def sliced_on_cpu(fn: Callable, when: Callable[..., bool], *, unroll: bool = False
                  ) -> Callable:
  """`fn`, whose vmap runs `fn` on one mapped slice after another in the program lowered for
  the CPU where `when(axis_size, in_batched, *args)` holds (`in_batched` as
  `jax.custom_batching.custom_vmap` gives it), and is JAX's batching of `fn` elsewhere and on
  other platforms. Nested vmaps are decided level by level.

  For work that XLA's CPU backend runs slower batched than slice by slice: a grouped
  convolution, or memory-bound work whose vmap multiplies its working set by the axis size.
  The slices run in a loop (`jax.lax.map`, `fn` compiled once) or, with `unroll`, as one call
  a slice written out, for operations that run many times slower inside XLA's loops on the
  CPU (convolutions; docs/benchmarks.md#a-loop-over-the-runs-inside-the-program).
  """

  @jax.custom_batching.custom_vmap
  def mappable(*args):
    return fn(*args)

  @mappable.def_vmap
  def batch_rule(axis_size, in_batched, *args):
    in_axes = jax.tree.map(lambda batched: 0 if batched else None, tuple(in_batched))

    def jax_batched(*args):
      return sliced_on_cpu(jax.vmap(fn, in_axes=in_axes), when, unroll=unroll)(*args)

    def one_slice_at_a_time(*args):
      def one_slice(i):
        return sliced_on_cpu(fn, when, unroll=unroll)(*_slice_args(args, in_axes, i))
      if unroll:
        return stack([one_slice(i) for i in range(axis_size)])
      return jax.lax.map(one_slice, jnp.arange(axis_size))

    if when(axis_size, in_batched, *args):
      out = jax.lax.platform_dependent(*args, cpu=one_slice_at_a_time, default=jax_batched)
    else:
      out = jax_batched(*args)
    return out, jax.tree.map(lambda _: True, out)

  return mappable


def stack(trees: Sequence[Any]) -> Any:
  """The pytrees `trees` (one a run, alike in structure) as one with a leading run axis."""
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def allocation_scalars(allocations: Sequence[registry.AllocationConfig], mesh: Mesh | None
                       ) -> dict[str, jax.Array]:
  """{field: [R] float32} of each run's `registry.SCALARS` (the threshold, the historical
  estimator's discount and prior), on the mesh's "runs" axis: the values that replace the
  shared config's in the step of run r."""
  return split_runs({name: np.asarray([getattr(run, name) for run in allocations], np.float32)
                     for name in registry.SCALARS}, mesh)


def run_state(states: Any, r: int) -> Any:
  """Run r's slice of a batched pytree (its optimizer state batched-shaped)."""
  return jax.tree.map(lambda x: x[r], states)


def runs_mesh(runs_devices: int, devices=None) -> Mesh:
  """A ("runs", "data") mesh: the run axis over `runs_devices` devices, each run's data
  over the rest (the devices ordered as `sharding.make_mesh` orders them).

  Raises:
    ValueError: `runs_devices` does not divide the device count.
  """
  ordered = sharding.make_mesh(devices).devices.reshape(-1)
  if runs_devices < 1 or ordered.size % runs_devices:
    raise ValueError(f"the runs axis ({runs_devices} devices) must divide the "
                     f"{ordered.size} devices.")
  return Mesh(ordered.reshape(runs_devices, -1), (RUNS_AXIS, sharding.DATA_AXIS))


def check_runs_divisible(num_runs: int, mesh: Mesh) -> None:
  """Refuses a batch whose runs do not split evenly over the mesh's "runs" axis."""
  if num_runs % mesh.shape[RUNS_AXIS]:
    raise ValueError(f"a batch of {num_runs} runs does not split over the "
                     f"{mesh.shape[RUNS_AXIS]} devices of the mesh's runs axis.")


def split_runs(tree: Any, mesh: Mesh | None) -> Any:
  """`tree` (leading run axis) on the mesh's "runs" axis, or as it is without a mesh."""
  if mesh is None:
    return tree
  return jax.device_put(tree, NamedSharding(mesh, PartitionSpec(RUNS_AXIS)))


def vmap_runs(fn: Callable, in_axes: Sequence[int | None], mesh: Mesh | None, *,
              loop_on_cpu: bool = False) -> Callable:
  """`fn` mapped over the run axis (axis 0 of the arguments whose `in_axes` entry is 0).

  A batch of one run without a mesh runs `fn` itself on the run's slice: XLA's CPU backend
  may lay out an array with a leading axis of size 1 otherwise than the run's own and copy
  it at every step of a loop (the maze policy's decoding cache, docs/benchmarks.md).

  With `loop_on_cpu` and no mesh, the program lowered for the CPU runs `fn` on one run after
  another inside it (`jax.lax.map`), and other platforms' programs vmap. For a memory-bound
  step, such as the maze policy's sampling, a vmap multiplies the working set by the number
  of runs and steps them slower on the CPU than the runs alone, where the loop keeps one
  run's working set (docs/benchmarks.md#a-loop-over-the-runs-inside-the-program).
  """
  mapped = jax.vmap(fn, in_axes=tuple(in_axes),
                    spmd_axis_name=RUNS_AXIS if mesh is not None else None)

  def runs_mapped(*args):
    if mesh is not None:
      return mapped(*args)
    first_mapped = next(arg for arg, axis in zip(args, in_axes, strict=True) if axis == 0)
    num_runs = jax.tree.leaves(first_mapped)[0].shape[0]
    if num_runs == 1:
      alone = fn(*_slice_args(args, in_axes, 0))
      return jax.tree.map(lambda x: jnp.expand_dims(x, 0), alone)

    def one_run_after_another(*args):
      return jax.lax.map(lambda r: fn(*_slice_args(args, in_axes, r)), jnp.arange(num_runs))

    if loop_on_cpu:
      return jax.lax.platform_dependent(*args, cpu=one_run_after_another, default=mapped)
    return mapped(*args)

  return runs_mapped


def map_runs(step, in_axes, mesh: Mesh | None, *, loop_on_cpu: bool = False):
  """`vmap_runs(step, ...)` jitted (the states, argument 0, donated)."""
  return jax.jit(vmap_runs(step, in_axes, mesh, loop_on_cpu=loop_on_cpu), donate_argnums=0)

