"""Maze navigation at the paper's scale: 17x17 mazes, a ~3.2M-parameter policy,
256 prompts x N0 = 128 rollouts a step (B = 32768). Meant for an accelerator.

  sera-jax train --config maze17 --config.method=uniform
"""

from sera_jax.harness.configs import maze


def get_config():
  config = maze.get_config()
  config.maze_size = 17
  config.num_train_mazes = 4096
  config.num_eval_mazes = 256
  config.dim = 256
  config.num_layers = 4
  config.num_heads = 8
  config.batch_size = 256
  config.baseline_n = 128
  config.n_max = 512
  config.num_steps = 2000
  config.learning_rate = 1e-4
  config.microbatches = 64  # 512 rollouts of 127 steps a chunk: a 14 GiB step (XLA)
  config.eval_every = 500
  config.eval_batch_size = 16
  config.checkpoint_every = 250
  return config
