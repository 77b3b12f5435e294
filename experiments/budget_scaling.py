"""`sera-jax figure scaling` as a script: held-out pass@k against N0 from the cold start
(synthetic1000) for cross-entropy, uniform MaxRL and SERA.

Options: `--help`.
"""

import sys

from sera_jax.harness.figures import scaling

if __name__ == "__main__":
  scaling.main(sys.argv[1:])
