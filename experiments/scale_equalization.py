"""`sera-jax figure scale` as a script: kappa under the uniform and SERA allocations.

Options: `--help`.
"""

import sys

from sera_jax.harness.figures import scale

if __name__ == "__main__":
  scale.main(sys.argv[1:])
