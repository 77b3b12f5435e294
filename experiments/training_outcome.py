"""`sera-jax figure outcome` as a script: held-out pass@k at the end of training, per method.

Options: `--help`.
"""

import sys

from sera_jax.harness.figures import outcome

if __name__ == "__main__":
  outcome.main(sys.argv[1:])
