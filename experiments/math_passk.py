"""`sera-jax figure math` as a script: held-out pass@k of SERA, uniform MaxRL and GRPO on
multi-digit addition, trained through the Tunix learner (the [llm] extra).

Options: `--help`.
"""

import sys

from sera_jax.harness.figures import math as math_figure

if __name__ == "__main__":
  math_figure.main(sys.argv[1:])
