"""The paper's ImageNet protocol: ResNet-50 from scratch, 20 epochs.

See docs/method.md#classification-as-rl.

Needs imagenet2012 prepared by tensorflow-datasets in config.dataset_kwargs.data_dir
(see docs/training.md); sized for an accelerator pod, not a CPU.
"""

import ml_collections

from sera_jax.harness.configs import base

IMAGENET_TRAIN_IMAGES = 1_281_167


def get_config():
  config = base.locked(base.classification())
  config.dataset = "imagenet2012"
  config.dataset_kwargs = ml_collections.ConfigDict({"data_dir": ""})
  config.model = "resnet50"
  config.batch_size = 256
  config.baseline_n = 128
  config.n_min = 2
  config.n_max = 512
  config.threshold = 0.05
  steps_per_epoch = IMAGENET_TRAIN_IMAGES // config.batch_size
  config.num_steps = 20 * steps_per_epoch
  config.warmup_steps = 2 * steps_per_epoch
  config.optimizer = "sgd"
  config.learning_rate = 0.1
  config.momentum = 0.9
  config.weight_decay = 1e-4
  config.schedule = "cosine"
  config.eval_every = steps_per_epoch
  config.eval_batch_size = 256  # divisible by every power-of-two device count up to 256
  config.checkpoint_every = 1000
  return config
