"""Maze navigation, CPU size: 9x9 mazes, a ~0.1M-parameter policy.

Warm start on BFS paths, then RL with the same rollout budget B = M * N0 for
every method:

  sera-jax train --config maze                          # SERA
  sera-jax train --config maze --config.method=uniform  # MaxRL
  sera-jax train --config maze --config.method=grpo
"""

import ml_collections

from sera_jax.method import success


def get_config():
  config = ml_collections.ConfigDict()
  config.task = "maze"
  config.method = "sera"  # sera | uniform | grpo | equalized | knapsack
  config.seed = 0  # model init, batch order and sampling
  config.data_seed = 0  # the training and held-out mazes (shared by all seeds and methods)
  # Held-out mazes whose shortest path no training maze shares: with 9x9 mazes most
  # solutions repeat, and a policy replaying training paths would score on them.
  config.novel_eval_paths = True
  # Mazes and policy.
  config.maze_size = 9
  config.max_steps = 0  # step limit T; 0 = the longest possible shortest path + 1
  config.num_train_mazes = 256
  config.num_eval_mazes = 64
  config.dim = 64
  config.num_layers = 2
  config.num_heads = 4
  # Rollout budget and SERA (docs/method.md#the-estimator-and-its-scale);
  # M = batch_size prompts, B = M * N0.
  config.batch_size = 32
  config.baseline_n = 8
  config.n_min = 2
  config.n_max = 32
  config.threshold = 0.05
  config.normalize_by_rollout_count = True
  config.normalize_by_rho = False
  config.estimator = ""  # a registered estimator; "" = the method's (grpo's, or maxrl)
  config.estimator_kwargs = ml_collections.ConfigDict()  # its parameters: k (pkpo), order
  # Historical success estimator (docs/method.md#estimating-p): the method's defaults.
  config.discount = success.DISCOUNT
  config.alpha0 = success.ALPHA0
  config.beta0 = success.BETA0
  # Optimisation: warm start on shortest paths for warmup_steps, then RL.
  config.num_steps = 320  # 20 warm-start + 300 RL steps: 5 seeds x 3 methods in < 30 min here
  config.warmup_steps = 20  # a weak start leaves hard mazes for RL (pass@1 about 0.2)
  config.warmup_learning_rate = 1e-3
  config.optimizer = "adam"  # adam | sgd
  config.learning_rate = 3e-4
  config.momentum = 0.9  # sgd only
  config.weight_decay = 0.0
  config.grad_clip_norm = 1.0
  config.microbatches = 1  # chunks of the B rollouts, sampled and differentiated in turn
  # Evaluation and checkpoints.
  # Validation mazes (to choose hyperparameters on; 0 = none): their shortest paths occur in
  # no training and no held-out maze. Scored as validation/pass@k at every evaluation.
  config.num_validation_mazes = 0
  config.eval_every = 320
  config.eval_samples = 256
  config.eval_batch_size = 16
  config.checkpoint_every = 100
  config.checkpoints_to_keep = 2
  config.profile_steps = ""  # "A:B": a jax.profiler trace of steps A..B-1 in workdir/profile
  config.lock()
  return config
