"""R maze runs as one program: a leading run axis, `MazeTask`'s steps vmapped.

The runs of a batch share every config value that fixes a shape or the compiled program
(the mazes and data_seed, the policy, batch_size, baseline_n, n_min, n_max, method,
estimator, ...) and may differ in `VARIED` alone: the seed (batch order, rollouts), the
optimizer's scalars and the allocation's (`sera_jax.common.episodes.BatchedEpisodes`), so
run r of a batch is the run config r trains alone (the allocation of
docs/method.md#the-waterline on docs/method.md#estimating-p's estimate), up to the rounding
of batched arithmetic. Every run starts from the shared warm start.
"""

from collections.abc import Sequence

import ml_collections

from sera_jax.common.episodes import VARIED, BatchedEpisodes
from sera_jax.settings.maze import task as maze_task

__all__ = ["VARIED", "BatchedMaze"]


class BatchedMaze(BatchedEpisodes):
  """R maze runs as one program, from the shared warm start."""

  def __init__(self, configs: Sequence[ml_collections.ConfigDict], mesh=None):
    super().__init__(maze_task, maze_task.MazeTask, configs, mesh)
