"""Base configs: every key an experiment may set, with its default.

The config files beside this module start from a base and override
fields; the base is locked, so a misspelt key fails when the file (or a
--config.key=value override) sets it, before anything is compiled.
"""

import ml_collections

PASS_AT_K_MAX = 1024


def classification() -> ml_collections.ConfigDict:
  """Classification as RL (docs/method.md#classification-as-rl), sized for a 2-core CPU."""
  config = ml_collections.ConfigDict()
  config.task = "classification"
  config.seed = 0
  # Data and model.
  config.dataset = "digits"  # digits | synthetic | imagenet2012 | tfds:<name>
  config.dataset_kwargs = ml_collections.ConfigDict()
  config.model = "mlp"  # mlp | small_cnn | resnet18 | resnet50
  config.model_kwargs = ml_collections.ConfigDict()
  # Method and SERA (docs/method.md#the-estimator-and-its-scale).
  config.method = "sera"  # sera | uniform | equalized | ce
  config.estimator = "maxrl"  # any registered name (sera_jax.method.estimators)
  config.estimator_kwargs = ml_collections.ConfigDict()  # its parameters: k (pkpo), order
  config.batch_size = 64  # M prompts per step
  config.baseline_n = 8  # N0: budget B = M * N0
  config.n_min = 2
  config.n_max = 32
  config.threshold = 0.05
  config.normalize_by_rollout_count = True
  config.normalize_by_rho = False
  # Optimisation.
  config.num_steps = 500
  config.optimizer = "sgd"  # sgd | adam
  config.learning_rate = 0.01
  config.momentum = 0.9
  config.weight_decay = 0.0
  config.schedule = "cosine"  # cosine | constant
  config.warmup_steps = 10
  # Measurement, evaluation, checkpoints.
  config.align_every = 1  # alignment (5 cotangents) every k steps; 1 = every step
  config.eval_every = 100
  config.eval_batch_size = 256
  config.checkpoint_every = 100
  config.checkpoints_to_keep = 2
  config.profile_steps = ""  # "A:B": a jax.profiler trace of steps A..B-1 in workdir/profile
  return config


def locked(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Locks `config` so that setting an unknown key raises."""
  config.lock()
  return config
