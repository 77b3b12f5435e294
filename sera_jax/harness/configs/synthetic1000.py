"""The ImageNet cold start on a CPU: 1000 generated classes, p ~ 1/C at step 0."""

import ml_collections

from sera_jax.harness.configs import base


def get_config():
  config = base.locked(base.classification())
  config.dataset = "synthetic"
  # num_validation > 0: that many fresh examples as a validation split (validation/pass@k).
  config.dataset_kwargs = ml_collections.ConfigDict({"num_classes": 1000, "num_validation": 0})
  config.model = "mlp"
  config.batch_size = 128
  config.baseline_n = 16
  config.n_max = 64
  config.num_steps = 400
  config.learning_rate = 0.2
  config.eval_every = 200
  config.checkpoint_every = 200
  return config
