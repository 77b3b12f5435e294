"""Point-mass navigation in MuJoCo MJX (the [sim] extra), CPU size: SERA over scenarios.

A scenario (start, goal, the wall's gap) is a prompt and an episode of 40 steps a rollout;
success is reaching the goal. The policy trains from scratch on a fixed set of 512 training
scenarios, B = M * N0 = 32 * 8 episodes a step; validation and held-out scenarios are fresh
draws of the same generator:

  sera-jax train --config sim_nav                          # SERA
  sera-jax train --config sim_nav --config.method=uniform  # MaxRL
  sera-jax train --config sim_nav --config.method=grpo
"""

import ml_collections

from sera_jax.method import success


def get_config():
  config = ml_collections.ConfigDict()
  config.task = "sim"
  config.environment = "point_mass"  # sera_jax.settings.sim.task.ENVIRONMENTS
  config.method = "sera"  # sera | uniform | grpo | equalized | knapsack
  config.seed = 0  # initialisation, batch order and the episodes' actions
  config.data_seed = 0  # the scenario generator: every set, shared by all seeds and methods
  config.num_train_scenarios = 512
  config.num_validation_scenarios = 128
  config.num_eval_scenarios = 128
  # The Gaussian policy.
  config.hidden_sizes = (64, 64)
  config.init_log_std = -0.5
  # Episode budget and SERA (docs/method.md#the-estimator-and-its-scale).
  config.batch_size = 32
  config.baseline_n = 8
  config.n_min = 2
  config.n_max = 32
  config.threshold = 0.05
  config.normalize_by_rollout_count = True
  config.normalize_by_rho = False
  config.estimator = ""  # a registered estimator; "" = the method's (grpo's, or maxrl)
  config.estimator_kwargs = ml_collections.ConfigDict()
  config.discount = success.DISCOUNT
  config.alpha0 = success.ALPHA0
  config.beta0 = success.BETA0
  # RL.
  config.num_steps = 300  # ~19 epochs of the training scenarios
  config.optimizer = "adam"  # adam | sgd
  config.learning_rate = 3e-3
  config.momentum = 0.9  # sgd only
  config.weight_decay = 0.0
  config.grad_clip_norm = 1.0
  # Evaluation and checkpoints: pass@1 ... pass@eval_samples.
  config.eval_sets = ("held_out", "validation")
  config.eval_every = 100
  config.eval_samples = 64
  config.eval_batch_size = 32
  config.checkpoint_every = 100
  config.checkpoints_to_keep = 2
  config.profile_steps = ""
  config.lock()
  return config
