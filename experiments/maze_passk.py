"""`sera-jax figure maze` as a script: held-out pass@k of SERA, uniform MaxRL and GRPO on mazes.

Options: `--help`.
"""

import sys

from sera_jax.harness.figures import maze

if __name__ == "__main__":
  maze.main(sys.argv[1:])
