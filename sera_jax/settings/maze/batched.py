"""R maze runs as one program: a leading run axis, the task's steps under `jax.vmap`.

The runs of a batch share every config value that fixes a shape or the compiled program
(the mazes and data_seed, the policy, batch_size, baseline_n, n_min, n_max, method,
estimator, ...) and may differ in `VARIED` alone: the seed (batch
order, rollouts), the optimizer's scalars and the allocation's (`registry.SCALARS`: the
threshold, the historical estimator's discount and prior). Those enter as traced arrays:
`optax.inject_hyperparams` keeps each run's rates, momentum, weight decay and clipping
norm in its optimizer state, and the RL step takes each run's allocation scalars
(`batching.allocation_scalars`) in place of the shared config's. The steps are `MazeTask`'s,
unchanged, mapped over the runs, so run r of a batch is the run config r trains alone
(the allocation of docs/method.md#the-waterline on docs/method.md#estimating-p's estimate),
up to the rounding of batched arithmetic.
"""

from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
import optax

from sera_jax.common import batching, optim, sharding
from sera_jax.method import registry
from sera_jax.settings.maze import task as maze_task

# The optimizer's scalars, each a traced hyperparameter of the batch's optimizer.
OPTIMIZER_SCALARS = ("learning_rate", "momentum", "weight_decay", "grad_clip_norm")
# The config keys that may differ between the runs of a batch; any other is refused.
VARIED = ("seed", *OPTIMIZER_SCALARS, *registry.SCALARS)


def check_batchable(configs: Sequence[ml_collections.ConfigDict]) -> None:
  """`batching.check_batchable` with the maze's `VARIED` keys."""
  batching.check_batchable(configs, VARIED)


def _optimizer_factory(config: ml_collections.ConfigDict):
  """`maze_task.make_optimizer`'s transformation, its scalars held as arrays in its state."""

  def chain(learning_rate, momentum, weight_decay, grad_clip_norm):
    return optax.chain(optax.clip_by_global_norm(grad_clip_norm),
                       optim.optimizer_chain(config.optimizer, learning_rate, momentum=momentum,
                                             weight_decay=weight_decay))
  return optax.inject_hyperparams(chain)


class BatchedMaze:
  """R maze runs trained as one program: `MazeTask`'s RL steps vmapped, from its warm start.

  One process: the runs' batches of maze ids are stacked on the host. With a `mesh`
  (`batching.runs_mesh`) the runs are split over its "runs" axis and each run's rollouts
  over its "data" axis; the number of runs must be a multiple of the "runs" axis's size.
  """

  def __init__(self, configs: Sequence[ml_collections.ConfigDict], mesh=None):
    check_batchable(configs)
    self.configs = list(configs)
    for config in self.configs:
      maze_task.validate_config(config)
      maze_task.make_optimizer(config)  # checks the run's optimizer values
    self.mesh = mesh
    if mesh is not None:
      batching.check_runs_divisible(len(self.configs), mesh)
    factory = _optimizer_factory(self.configs[0])
    self._optimizers = [factory(**{name: config[name] for name in OPTIMIZER_SCALARS})
                        for config in self.configs]
    # Every run's optimizer updates alike: it reads the run's scalars from its state.
    self.task = maze_task.MazeTask(self.configs[0], mesh=mesh,
                                   optimizer=factory(**dict.fromkeys(OPTIMIZER_SCALARS, 1.0)))
    self._scalars = batching.allocation_scalars(
        [maze_task.allocation_config(config) for config in self.configs], mesh)
    # Sampling is memory-bound: on the CPU the runs' RL steps and evaluations loop over the
    # runs inside the program (`batching.vmap_runs`).
    self._rl_step = batching.map_runs(self.task.rl_step_fn, (0, 0, None, None, 0), mesh,
                                      loop_on_cpu=True)
    self._eval_successes = jax.jit(batching.vmap_runs(
        self.task.eval_successes_fn, (0, 0, None, None, None), mesh, loop_on_cpu=True))

  @property
  def num_runs(self) -> int:
    return len(self.configs)

  def init_state(self) -> maze_task.MazeState:
    """Every run's initial state, each from PRNGKey(its seed) as a run alone (the shared warm
    start, its seed's rng), stacked.

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

  def train_step(self, states: maze_task.MazeState, step: int):
    """One step of every run: (states, metrics of [R] arrays)."""
    batches = [maze_task.batch_ids(config, step) for config in self.configs]
    ids = batching.split_runs(np.stack([ids for ids, _ in batches]), self.mesh)
    new_epoch = batches[0][1]  # the step's alone: the same for every run
    return self._rl_step(states, ids, step, new_epoch, self._scalars)

  def evaluate(self, states: maze_task.MazeState) -> list[dict[str, float]]:
    """Each run's `MazeTask.evaluate`, every run's samples drawn in one vmapped program."""
    metrics = self.task.pass_at_k(
        lambda *args: self._eval_successes(states.params, states.rng, *args))
    return [{name: float(values[r]) for name, values in metrics.items()}
            for r in range(self.num_runs)]

  def write_figures(self, workdir: str, rows: list[dict]) -> None:
    """A run's figures, as `MazeTask.write_figures` draws them."""
    self.task.write_figures(workdir, rows)
