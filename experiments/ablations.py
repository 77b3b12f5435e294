"""`sera-jax figure ablations` as a script: SERA's components changed one at a time.

Options: `--help`.
"""

import sys

from sera_jax.harness.figures import ablations

if __name__ == "__main__":
  ablations.main(sys.argv[1:])
