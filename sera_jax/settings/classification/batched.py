"""R classification runs as one program: a leading run axis, one jitted step under `jax.vmap`.

The runs of a batch share every config value that fixes a shape or the compiled
program (dataset, model, batch_size, baseline_n, n_min, n_max, method, estimator, ...)
and may differ in `VARIED` alone: the seed (initial parameters, data order, rollouts),
the optimizer's scalars and the allocation's (`registry.SCALARS`: the threshold, ...).
Those enter as traced arrays: `optax.inject_hyperparams` keeps each run's learning rate,
momentum and weight decay in its optimizer state, the schedule's shape (warm-up, decay)
multiplies the run's peak rate, and the step takes each run's allocation scalars
(`batching.allocation_scalars`) in place of the shared config's. The step is
`task.make_train_step`'s, mapped over the runs, so run r of a batch is the run config r
trains alone (docs/method.md#classification-as-rl), up to the rounding of batched arithmetic.
Without a mesh, a batch with many rollouts in all samples them one run after another inside
the program on the CPU (`gradients.sample_and_score_in_slices`): that sampling is
memory-bound, and vmapped it slowed the batch below the runs one after another.
"""

from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
import optax

from sera_jax.common import batching, optim
from sera_jax.method import registry
from sera_jax.settings.classification import allocations, task

# The config keys that may differ between the runs of a batch; any other is refused.
VARIED = ("seed", "learning_rate", "momentum", "weight_decay", *registry.SCALARS)


def check_batchable(configs: Sequence[ml_collections.ConfigDict]) -> None:
  """`batching.check_batchable` with the classification's `VARIED` keys."""
  batching.check_batchable(configs, VARIED)


def _unit_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """The config's schedule with a peak rate of 1: a run's rate is its peak times this."""
  unit = config.copy_and_resolve_references()
  unit.learning_rate = 1.0
  return optim.learning_rate_schedule(unit)


def _optimizer_factory(config: ml_collections.ConfigDict):
  """`optim.make_optimizer`'s transformation, its scalars held as arrays in its state."""
  unit = _unit_schedule(config)

  def chain(learning_rate, momentum, weight_decay):
    return optim.optimizer_chain(config.optimizer, lambda count: learning_rate * unit(count),
                                 momentum=momentum, weight_decay=weight_decay)
  return optax.inject_hyperparams(chain)


def _optimizer(factory, config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  optim.make_optimizer(config)  # checks the run's values
  return factory(learning_rate=config.learning_rate, momentum=config.momentum,
                 weight_decay=config.weight_decay)


def make_batched_train_step(model, config: ml_collections.ConfigDict, *, align: bool,
                            mesh=None):
  """The jitted step of R runs: (states, images, labels, step, scalars) -> (states, metrics).

  States, images [R, M, ...], labels [R, M] and the allocation's scalars
  (`batching.allocation_scalars`) carry the run axis first; every metric is [R]. `config`
  is any run's (their shared keys). With a `mesh`
  (`batching.runs_mesh`) the run axis is split over its "runs" axis.
  """
  factory = _optimizer_factory(config)
  unit = _unit_schedule(config)
  # Every run's optimizer updates alike: it reads the run's scalars from its state.
  optimizer = factory(learning_rate=1.0, momentum=0.0, weight_decay=0.0)
  step = task.make_train_step(
      model, optimizer, config, align=align,
      learning_rate=lambda opt_state, step: opt_state.hyperparams["learning_rate"] * unit(step),
      runs_loop_on_cpu=mesh is None)
  return batching.map_runs(step, (0, 0, 0, None, 0), mesh)


run_state = batching.run_state


class BatchedClassification:
  """R classification runs trained as one program (`make_batched_train_step`).

  One process: the runs' batches are stacked on the host. With a `mesh`
  (`batching.runs_mesh`) the runs are split over its "runs" axis; the number of runs
  must be a multiple of that axis's size.
  """

  def __init__(self, configs: Sequence[ml_collections.ConfigDict], mesh=None):
    check_batchable(configs)
    self.configs = list(configs)
    self.mesh = mesh
    if mesh is not None:
      batching.check_runs_divisible(len(self.configs), mesh)
    self.task = task.ClassificationTask(self.configs[0])  # dataset, model, evaluation
    factory = _optimizer_factory(self.configs[0])
    self._optimizers = [_optimizer(factory, config) for config in self.configs]
    # Any mode's config: the scalars are the run's whatever it allocates.
    self._scalars = batching.allocation_scalars(
        [allocations.allocation_config(config, "sera") for config in self.configs], mesh)
    self._steps = {align: make_batched_train_step(self.task.model, self.configs[0], align=align,
                                                  mesh=mesh)
                   for align in (True, False)}

  @property
  def num_runs(self) -> int:
    return len(self.configs)

  def init_state(self) -> task.TrainState:
    """Every run's initial state, each from PRNGKey(its seed) as a run alone, stacked."""
    states = [task.init_train_state(self.task.model, optimizer, jax.random.PRNGKey(config.seed))
              for optimizer, config in zip(self._optimizers, self.configs, strict=True)]
    return batching.split_runs(batching.stack(states), self.mesh)

  def _batches(self, step: int):
    config = self.configs[0]
    batches = [self.task.dataset.train_batch(step, config.batch_size, run.seed)
               for run in self.configs]
    return batching.split_runs((np.stack([batch["image"] for batch in batches]),
                                np.stack([batch["label"] for batch in batches])), self.mesh)

  def train_step(self, states: task.TrainState, step: int):
    """One step of every run: (states, metrics of [R] arrays)."""
    images, labels = self._batches(step)
    align = step % self.configs[0].align_every == 0
    return self._steps[align](states, images, labels, step, self._scalars)

  def evaluate(self, states: task.TrainState) -> list[dict[str, float]]:
    """Each run's `ClassificationTask.evaluate`, run by run."""
    states = jax.device_get(states)
    return [self.task.evaluate(run_state(states, r)) for r in range(self.num_runs)]

  def write_figures(self, workdir: str, rows: list[dict]) -> None:
    """A run's figures, as `ClassificationTask.write_figures` draws them."""
    self.task.write_figures(workdir, rows)
