"""R simulation runs as one program: `SimTask`'s steps vmapped over a leading run axis.

The runs of a batch share every config value that fixes a shape or the program (the
environment, the scenarios, the policy, the budget, the method) and may differ in
`VARIED` alone (`sera_jax.common.episodes.BatchedEpisodes`).
"""

from collections.abc import Sequence

import ml_collections

from sera_jax.common.episodes import VARIED, BatchedEpisodes
from sera_jax.settings.sim import task as sim_task

__all__ = ["VARIED", "BatchedSim"]


class BatchedSim(BatchedEpisodes):
  """R simulation runs as one program."""

  def __init__(self, configs: Sequence[ml_collections.ConfigDict], mesh=None):
    super().__init__(sim_task, sim_task.SimTask, configs, mesh)
