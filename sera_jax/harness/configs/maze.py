"""Maze navigation, CPU size: 13x13 mazes, a ~0.1M-parameter policy, the paper's protocol.

One warm start (imitation of BFS paths on a pool of mazes disjoint from every other set, each
seen once), shared by every seed and method; then RL on a fixed set of 768 mazes (12.5
epochs) with the same rollout budget B = M * N0 for every method; held-out and validation
sets of 256 fresh i.i.d. mazes each, 512 samples a maze:

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
  config.seed = 0  # batch order and sampling (every seed starts from the same warm start)
  config.data_seed = 0  # the maze sets and so the warm start (shared by all seeds and methods)
  # Mazes and policy.
  config.maze_size = 13
  config.max_steps = 0  # step limit T; 0 = the longest possible shortest path + 1
  config.num_train_mazes = 768  # the fixed RL set
  config.num_eval_mazes = 256  # held-out: fresh i.i.d. mazes
  # Validation mazes (fresh i.i.d., to choose hyperparameters on; 0 = none), scored as
  # validation/pass@k.
  config.num_validation_mazes = 256
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
  # The warm start (`sera_jax.settings.maze.warm_start`): num_sft_mazes pool mazes, each once,
  # sft_batch_size a step, Adam on a cosine decay from sft_learning_rate; the pool shares no
  # maze, and with sft_disjoint_paths no shortest path, with the RL and evaluation sets.
  config.num_sft_mazes = 3200
  config.sft_batch_size = 32
  config.sft_learning_rate = 5e-4
  config.sft_seed = 0  # the warm start's initial parameters (not the run's seed)
  config.sft_disjoint_paths = True
  config.warm_start_dir = ""  # where the warm start is kept ("" = remade by each process)
  # RL.
  config.num_steps = 300  # 12.5 epochs of the RL set
  config.optimizer = "adam"  # adam | sgd
  config.learning_rate = 1e-4
  config.momentum = 0.9  # sgd only
  config.weight_decay = 0.0
  config.grad_clip_norm = 1.0
  config.microbatches = 1  # chunks of the B rollouts, sampled and differentiated in turn
  # Evaluation and checkpoints: pass@1 ... pass@eval_samples on the sets of eval_sets.
  config.eval_sets = ("held_out", "validation")
  config.eval_every = 300
  config.eval_samples = 512
  config.eval_batch_size = 16
  config.checkpoint_every = 100
  config.checkpoints_to_keep = 2
  config.profile_steps = ""  # "A:B": a jax.profiler trace of steps A..B-1 in workdir/profile
  config.lock()
  return config
