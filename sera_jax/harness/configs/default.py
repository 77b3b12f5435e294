"""The main job: SERA on scikit-learn's embedded 8x8 digits, an MLP, 500 steps on a CPU.

sera-jax train                                  # this config
sera-jax train --config.method=uniform          # the MaxRL baseline
"""

import ml_collections

from sera_jax.harness.configs import base


def get_config():
  config = base.locked(base.classification())
  # > 0 sets that many training images aside as a validation split (validation/pass@k).
  config.dataset_kwargs = ml_collections.ConfigDict({"num_validation": 0})
  return config
