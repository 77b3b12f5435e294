"""Maze navigation as the paper's authors ran it (their `maze/maze_17.sh`), key by key:
17x17 mazes, a ~3.2M-parameter policy, a fixed RL set of 7,424 mazes (~103 epochs in 3,000
steps of 256 mazes x N0 = 128 rollouts, B = 32,768), one warm start of 1,500 x 32 pool mazes,
256 held-out mazes x 2,048 samples. Meant for an accelerator; docs/training.md#maze17-against-
the-authors-script lists each setting beside theirs and where this one differs.

  sera-jax train --config maze17                         # SERA
  sera-jax train --config maze17 --config.method=uniform
"""

from sera_jax.harness.configs import maze


def get_config():
  config = maze.get_config()
  config.maze_size = 17
  config.num_train_mazes = 7424  # their fixed_train7424_seed42
  config.num_eval_mazes = 256
  config.num_validation_mazes = 256
  # Their Qwen2 of hidden 256, 4 layers, 4 heads (2 key-value heads), MLP 1024 (= 4 * dim).
  config.dim = 256
  config.num_layers = 4
  config.num_heads = 4
  config.batch_size = 256
  config.baseline_n = 128
  config.n_max = 512
  # Their warm start (ckpt-1500): 1,500 steps of 32 mazes at 5e-4 on a cosine decay.
  config.num_sft_mazes = 1500 * 32
  config.sft_batch_size = 32
  config.sft_learning_rate = 5e-4
  config.num_steps = 3000
  config.learning_rate = 1e-4  # constant, as theirs
  config.weight_decay = 0.01  # verl's AdamW default
  config.microbatches = 64  # 512 rollouts a chunk: a 14 GiB step (XLA's compiled memory)
  config.eval_samples = 2048
  config.eval_every = 250  # their test_freq
  config.eval_batch_size = 4  # x 2,048 samples: 8,192 sequences sampled at a time
  config.checkpoint_every = 250  # their save_freq
  return config
