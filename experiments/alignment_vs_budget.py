"""`sera-jax figure budget` as a script: cosine with the exact gradient against the budget.

Options: `--help`.
"""

import sys

from sera_jax.harness.figures import budget

if __name__ == "__main__":
  budget.main(sys.argv[1:])
