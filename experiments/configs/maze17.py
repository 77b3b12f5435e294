"""Maze navigation at the paper's scale (issue 5): 17x17 mazes, a ~3.2M-parameter policy,
256 prompts x N0 = 128 rollouts a step (B = 32768). Meant for an accelerator.

  sera-jax train --config experiments/configs/maze17.py --config.method=uniform
"""

import importlib.util
import pathlib


def _cpu_config():
  spec = importlib.util.spec_from_file_location(
      "maze_cpu_config", pathlib.Path(__file__).with_name("maze.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def get_config():
  config = _cpu_config()
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
  config.warmup_steps = 400
  config.learning_rate = 1e-4
  config.microbatches = 16  # 2048 rollouts of 127 steps per gradient chunk
  config.eval_every = 500
  config.eval_batch_size = 16
  config.checkpoint_every = 250
  return config
