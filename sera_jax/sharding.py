"""Device mesh and data-parallel placement (SPMD over a named mesh).

The batch and every per-prompt array are sharded along the mesh axis "data";
parameters and optimizer state are replicated. The allocation stays global:
`allocate` runs on the whole global batch inside the jitted step, and XLA
inserts the collectives, so counts are identical to a single-device run.
"""

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
  """A one-axis mesh named "data" over all (global) devices."""
  devices = np.asarray(jax.devices() if devices is None else devices)
  return Mesh(devices.reshape(-1), (DATA_AXIS,))


def check_batch_divisible(batch_size: int, mesh: Mesh) -> None:
  """Rejects a global batch that does not split evenly over devices and hosts."""
  num_devices = mesh.devices.size
  if batch_size % num_devices:
    raise ValueError(
        f"batch_size must be divisible by the number of devices; got batch_size={batch_size} "
        f"with {num_devices} devices.")


def data_sharding(mesh: Mesh) -> NamedSharding:
  """Leading axis split over "data"."""
  return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def global_batch(local_batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Assembles each host's slice of the batch into global arrays sharded on "data"."""
  sharding = data_sharding(mesh)
  return {name: jax.make_array_from_process_local_data(sharding, value)
          for name, value in local_batch.items()}


def replicate(tree, mesh: Mesh):
  """Places a pytree (identical on every host) replicated over the mesh."""
  return jax.device_put(tree, replicated(mesh))
