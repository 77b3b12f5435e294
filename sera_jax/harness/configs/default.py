"""The main job: SERA on scikit-learn's embedded 8x8 digits, an MLP, 500 steps on a CPU.

sera-jax train                                  # this config
sera-jax train --config.method=uniform          # the MaxRL baseline
"""

from sera_jax.harness.configs import base


def get_config():
  config = base.locked(base.classification())
  return config
