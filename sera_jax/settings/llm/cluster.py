"""An RLCluster for the SERA learner on ("fsdp", "tp") device meshes.

The actor (and an optional reference) live on one mesh; the rollout shares it
(colocated: one copy of the weights) or has a mesh of its own (disaggregated:
Tunix keeps a second copy there and reshards the actor's weights into it after
every optimizer step). Generation uses Tunix's vanilla sampler (no vLLM), so
the same builder serves the CPU tasks, one accelerator host, and a multi-host
slice driven by one Pathways controller.
"""

from collections.abc import Sequence

import jax
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.rollout import base_rollout
from tunix.sft import metrics_logger

from sera_jax.method import validation

AXES = ("fsdp", "tp")  # the axes Tunix's model sharding annotations name


def make_mesh(shape: Sequence[int], devices: Sequence[jax.Device] | None = None
              ) -> jax.sharding.Mesh:
  """An ("fsdp", "tp") mesh of `shape` with Auto axes (Tunix's partitioned layers need them).

  Args:
    shape: (fsdp, tp), both >= 1.
    devices: the mesh's fsdp * tp devices; default the first fsdp * tp of `jax.devices()`.
  """
  fsdp, tp = (validation.integer(f"the mesh's {axis} size", size, minimum=1)
              for axis, size in zip(AXES, shape, strict=True))
  devices = list(jax.devices()[:fsdp * tp] if devices is None else devices)
  if len(devices) != fsdp * tp:
    raise ValueError(f"an (fsdp, tp) = ({fsdp}, {tp}) mesh needs {fsdp * tp} devices; got "
                     f"{len(devices)} (this process sees {jax.device_count()}).")
  return jax.make_mesh((fsdp, tp), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=devices)


def build(actor: nnx.Module, tokenizer, mesh: jax.sharding.Mesh, *,
          optimizer: optax.GradientTransformation, max_steps: int,
          rollout_config: base_rollout.RolloutConfig, reference: nnx.Module | None = None,
          checkpoint_dir: str | None = None, save_every: int = 100, max_to_keep: int = 2,
          log_dir: str | None = None, batch_size: int | None = None,
          train_micro_batch_size: int | None = None,
          rollout_mesh: jax.sharding.Mesh | None = None) -> rl_cluster_lib.RLCluster:
  """The cluster `SeraLearner` (or Tunix's GRPOLearner) trains.

  Args:
    actor: the policy to train (a Tunix model).
    tokenizer: anything with encode/decode/bos_id/eos_id/pad_id.
    mesh: the actor's and the reference's mesh (axes "fsdp" and "tp", `make_mesh`).
    optimizer: the actor's optax transformation.
    max_steps: training steps (optimizer steps).
    rollout_config: generation lengths, temperature and the KV cache size.
    reference: the frozen reference policy, needed only for a KL penalty (beta > 0).
    checkpoint_dir: Tunix checkpoints (and SERA's estimator) go here, a local
      path or a gs:// URL; resumed when it holds some.
    save_every, max_to_keep: the checkpoint interval (steps) and how many to keep.
    log_dir: Tunix's metrics logger writes TensorBoard events here.
    batch_size, train_micro_batch_size: M prompts a step, and the prompts whose
      rollouts one backward pass holds (gradients accumulate over M / this, one
      optimizer step per batch); both None: the whole step at once. The
      learner still receives all M prompts together, so SERA allocates over the
      batch.
    rollout_mesh: the sampler's mesh; default `mesh` (colocated). Other devices
      disaggregate: the rollout holds its own copy of the weights, refreshed
      from the actor's after every optimizer step.
  """
  micro = {}
  if train_micro_batch_size is not None:
    if batch_size is None or batch_size % train_micro_batch_size:
      raise ValueError(f"train_micro_batch_size ({train_micro_batch_size}) must divide the "
                       f"batch_size ({batch_size}).")
    micro = dict(mini_batch_size=batch_size, rollout_micro_batch_size=batch_size,
                 train_micro_batch_size=train_micro_batch_size,
                 compute_logps_micro_batch_size=train_micro_batch_size)
  options = None
  if checkpoint_dir:
    options = ocp.CheckpointManagerOptions(save_interval_steps=save_every,
                                           max_to_keep=max_to_keep)
  logging = None
  if log_dir:
    logging = metrics_logger.MetricsLoggerOptions(log_dir=log_dir,
                                                  backend_kwargs={"custom_backend": []})
  config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                    rl_cluster_lib.Role.ROLLOUT: mesh if rollout_mesh is None else rollout_mesh},
      rollout_engine="vanilla",
      offload_to_cpu=False,
      training_config=rl_cluster_lib.RLTrainingConfig(
          actor_optimizer=optimizer, eval_every_n_steps=10_000_000, max_steps=max_steps,
          checkpoint_root_directory=checkpoint_dir, checkpointing_options=options,
          metrics_logging_options=logging, **micro),
      rollout_config=rollout_config)
  with jax.set_mesh(mesh):
    return rl_cluster_lib.RLCluster(actor=actor, reference=reference, tokenizer=tokenizer,
                                    cluster_config=config)
