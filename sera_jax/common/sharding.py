"""Device mesh and data-parallel placement (SPMD over a named mesh).

The batch and every per-prompt array are sharded along the mesh axis "data";
parameters and optimizer state are replicated. The allocation stays global:
inside the jitted step log p is gathered and every device runs `allocate` on
the whole global batch (`on_every_device`), so counts are identical to a
single-device run. No `model` axis: parameters are replicated.
"""

import collections

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None) -> None:
  """Joins this process to a multi-host job (`jax.distributed.initialize`).

  With no arguments JAX detects the cluster (TPU pods, SLURM, Open MPI);
  give the coordinator explicitly elsewhere.
  """
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id)


def make_mesh(devices=None) -> Mesh:
  """A one-axis mesh named "data" over all (global) devices, host by host.

  Devices are ordered by (process, id), so host i holds the i-th contiguous
  block of the data axis: the rows its input pipeline loads
  (`train_batch(process_index=i)`) are exactly the rows its devices own.
  """
  devices = jax.devices() if devices is None else list(devices)
  per_process = collections.Counter(device.process_index for device in devices)
  if len(set(per_process.values())) > 1:
    raise ValueError(f"every process must hold the same number of devices; got "
                     f"{dict(sorted(per_process.items()))} devices per process.")
  ordered = sorted(devices, key=lambda device: (device.process_index, device.id))
  return Mesh(np.asarray(ordered), (DATA_AXIS,))


def check_batch_divisible(name: str, batch_size: int, num_devices: int) -> None:
  """Rejects a global batch that does not split evenly over the devices (hence the hosts)."""
  if batch_size % num_devices:
    raise ValueError(
        f"{name} must be divisible by the device count; got {name}={batch_size} "
        f"with {num_devices} devices.")


def data_sharding(mesh: Mesh) -> NamedSharding:
  """Leading axis split over "data"."""
  return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
  """The same full copy on every device of the mesh."""
  return NamedSharding(mesh, PartitionSpec())


def split_rows(x: jax.Array, mesh: Mesh, axis: int = 0) -> jax.Array:
  """Inside jit: `x` split along `axis` over "data" (its other axes whole on every device)."""
  return jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, PartitionSpec(*(None,) * axis, DATA_AXIS)))


def global_batch(local_batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Assembles each host's slice of the batch into global arrays sharded on "data"."""
  sharding = data_sharding(mesh)
  return {name: jax.make_array_from_process_local_data(sharding, value)
          for name, value in local_batch.items()}


def on_every_device(fn, mesh: Mesh):
  """`fn` run whole, on the whole of its inputs, on every device of `mesh` (inside jit).

  Inputs are gathered once and outputs come back replicated. For a global
  computation on small per-prompt arrays (the allocation): every device solves
  it locally, exactly as one device would, with no collective inside its loops.
  """
  return jax.shard_map(fn, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec())


def replicate(tree, mesh: Mesh):
  """Places a pytree (identical on every host) replicated over the mesh."""
  return jax.device_put(tree, replicated(mesh))
