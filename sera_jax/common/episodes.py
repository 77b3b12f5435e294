"""What the settings whose rollouts are episodes over a fixed prompt set share (maze, sim).

A prompt (a maze, a simulated scenario) offers its allocation log p alone (`INPUTS`); the
methods are "grpo" (uniform counts with GRPO's advantages) and the registered modes fed by
log p, trained with clipped Adam or SGD at a constant rate (`make_optimizer`), measured by
the step's success means and by pass@k for k = 1, 2, 4, ... (`pass_at_ks`).
`BatchedEpisodes` trains R runs of such a setting as one program: the task's steps unchanged,
mapped over a leading run axis; the runs may differ in `VARIED` alone (the seed, the
optimizer's scalars and the allocation's, `registry.SCALARS`), which enter as traced arrays
(`optax.inject_hyperparams` keeps each run's in its optimizer state), so run r of a batch is
the run config r trains alone, up to the rounding of batched arithmetic.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from sera_jax.common import batching, optim, sharding
from sera_jax.method import registry, validation

INPUTS = ("log_p",)  # what a prompt offers an allocation (`registry.AllocationInputs`)


def pass_at_ks(num_samples: int) -> tuple[int, ...]:
  """The k reported from `num_samples` samples a prompt: 1, 2, 4, ... up to num_samples."""
  return tuple(2**i for i in range(int(np.log2(num_samples)) + 1))


def success_means(counts: jax.Array, successes: jax.Array, log_p_estimate: jax.Array, *,
                  prompt: str) -> dict[str, jax.Array]:
  """The step's success rate per prompt, over the whole batch and over the prompts rolled out.

  "reward/{prompt}_mean" averages all M prompts, so every method is measured on the same
  set: a prompt with rollouts counts its observed rate successes / counts, one without
  (SERA's inactive prompts) its success estimate exp(log_p_estimate).
  "reward/active_{prompt}_mean" averages only the prompts with rollouts.

  Args:
    counts: int [M] rollouts of each prompt.
    successes: [M] successes among them.
    log_p_estimate: [M] the estimate of log p the allocation used.
    prompt: what the setting calls a prompt ("maze", "scenario").
  """
  rolled_out = counts > 0
  observed = successes / jnp.maximum(counts, 1)
  return {
      f"reward/{prompt}_mean": jnp.mean(jnp.where(rolled_out, observed,
                                                  jnp.exp(log_p_estimate))),
      f"reward/active_{prompt}_mean": jnp.sum(jnp.where(rolled_out, observed, 0.0))
                                      / jnp.maximum(jnp.sum(rolled_out), 1),
  }


def allocation_config(config: ml_collections.ConfigDict, *, setting: str
                      ) -> registry.AllocationConfig:
  """The allocation of `config.method`: "grpo" (uniform counts with GRPO's advantages) or a
  registered mode that log p alone feeds (`registry.modes_fed_by(INPUTS)`). Its estimator is
  config.estimator with config.estimator_kwargs; "" (or no such key) is the method's, GRPO's
  for "grpo" and centered MaxRL's otherwise. `setting` names the setting in errors.

  Raises:
    ValueError: an unknown method or estimator, a mode the setting cannot feed, or a bad
      allocation value.
  """
  validation.choice("config.method", config.method, ("grpo", *registry.MODES))
  grpo = config.method == "grpo"
  mode = "uniform" if grpo else config.method
  registry.require(mode, INPUTS, who=setting)
  estimator = config.get("estimator") or ("grpo" if grpo else "maxrl")
  if grpo and estimator != "grpo":
    raise ValueError(f"config.method 'grpo' scores with GRPO's advantages; for the estimator "
                     f"{estimator!r} with uniform counts set config.method to 'uniform'.")
  return registry.AllocationConfig.from_fields(config, prefix="config.", mode=mode,
                                               estimator=estimator)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Clipped Adam(W) or SGD at the constant RL rate config.learning_rate."""
  return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm),
                     optim.make_optimizer(config, optax.constant_schedule(config.learning_rate)))


# The optimizer's scalars, each a traced hyperparameter of the batch's optimizer.
OPTIMIZER_SCALARS = ("learning_rate", "momentum", "weight_decay", "grad_clip_norm")
# The config keys that may differ between the runs of a batch; any other is refused.
VARIED = ("seed", *OPTIMIZER_SCALARS, *registry.SCALARS)


def check_batchable(configs: Sequence[ml_collections.ConfigDict]) -> None:
  """`batching.check_batchable` with the `VARIED` keys."""
  batching.check_batchable(configs, VARIED)


def _optimizer_factory(config: ml_collections.ConfigDict):
  """`make_optimizer`'s transformation, its scalars held as arrays in its state."""

  def chain(learning_rate, momentum, weight_decay, grad_clip_norm):
    return optax.chain(optax.clip_by_global_norm(grad_clip_norm),
                       optim.optimizer_chain(config.optimizer, learning_rate, momentum=momentum,
                                             weight_decay=weight_decay))
  return optax.inject_hyperparams(chain)


class BatchedEpisodes:
  """R runs trained as one program: the RL steps of the task `task_class` of `task_module`
  (a module with `validate_config`, `allocation_config` and `batch_ids`; a task with the
  maze's `rl_step_fn`, `eval_successes_fn`, `pass_at_k` and `init_state`) vmapped.

  One process: the runs' batches of prompt ids are stacked on the host. With a `mesh`
  (`batching.runs_mesh`) the runs are split over its "runs" axis and each run's rollouts
  over its "data" axis; the number of runs must be a multiple of the "runs" axis's size.
  """

  def __init__(self, task_module, task_class, configs: Sequence[ml_collections.ConfigDict],
               mesh=None):
    check_batchable(configs)
    self.module = task_module
    self.configs = list(configs)
    for config in self.configs:
      task_module.validate_config(config)
      make_optimizer(config)  # checks the run's optimizer values
    self.mesh = mesh
    if mesh is not None:
      batching.check_runs_divisible(len(self.configs), mesh)
    factory = _optimizer_factory(self.configs[0])
    self._optimizers = [factory(**{name: config[name] for name in OPTIMIZER_SCALARS})
                        for config in self.configs]
    # Every run's optimizer updates alike: it reads the run's scalars from its state.
    self.task = task_class(self.configs[0], mesh=mesh,
                           optimizer=factory(**dict.fromkeys(OPTIMIZER_SCALARS, 1.0)))
    self._scalars = batching.allocation_scalars(
        [task_module.allocation_config(config) for config in self.configs], mesh)
    # Sampling is memory-bound: on the CPU the runs' RL steps and evaluations loop over the
    # runs inside the program (`batching.vmap_runs`).
    self._rl_step = batching.map_runs(self.task.rl_step_fn, (0, 0, None, None, 0), mesh,
                                      loop_on_cpu=True)
    self._eval_successes = jax.jit(batching.vmap_runs(
        self.task.eval_successes_fn, (0, 0, None, None, None), mesh, loop_on_cpu=True))

  @property
  def num_runs(self) -> int:
    return len(self.configs)

  def init_state(self):
    """Every run's initial state, each from PRNGKey(its seed) as a run alone (the maze's
    shared warm start, its seed's rng), stacked.

    Without a runs mesh it lies on the task's mesh, as the states the steps return do: a
    state placed otherwise would compile the first step a second time.
    """
    states = []
    for optimizer, config in zip(self._optimizers, self.configs, strict=True):
      state = self.task.init_state(jax.random.PRNGKey(config.seed))
      states.append(state._replace(opt_state=optimizer.init(state.params)))
    stacked = jax.device_get(batching.stack(states))
    if self.mesh is None:
      return sharding.replicate(stacked, self.task.mesh)
    return batching.split_runs(stacked, self.mesh)

  def train_step(self, states, step: int):
    """One step of every run: (states, metrics of [R] arrays)."""
    batches = [self.module.batch_ids(config, step) for config in self.configs]
    ids = batching.split_runs(np.stack([ids for ids, _ in batches]), self.mesh)
    new_epoch = batches[0][1]  # the step's alone: the same for every run
    return self._rl_step(states, ids, step, new_epoch, self._scalars)

  def evaluate(self, states) -> list[dict[str, float]]:
    """Each run's `evaluate`, every run's samples drawn in one vmapped program."""
    metrics = self.task.pass_at_k(
        lambda *args: self._eval_successes(states.params, states.rng, *args))
    return [{name: float(values[r]) for name, values in metrics.items()}
            for r in range(self.num_runs)]

  def write_figures(self, workdir: str, rows: list[dict]) -> None:
    """A run's figures, as the task's `write_figures` draws them."""
    self.task.write_figures(workdir, rows)
