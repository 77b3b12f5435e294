"""The math figure (`sera-jax figure math`, sera_jax.harness.figures.math): multi-digit
addition through Tunix's learner, a 2-layer Qwen2 warm-started, then RL at B = M * N0.

Not a `sera-jax train` run: the figure trains every arm (its `method` and `estimator`) at
each learning rate of `learning_rates` for every seed; `--tiny` shrinks it to a smoke run.
"""

import ml_collections


def get_config():
  config = ml_collections.ConfigDict()
  # Problem sets (sera_jax.settings.llm.arithmetic): disjoint, the same for every seed.
  config.digits = 3
  config.warm_start_problems = 2048
  config.train_problems = 1024
  config.validation_problems = 128
  config.held_out_problems = 128
  # The decoder (sera_jax.settings.llm.tiny.decoder) and its supervised warm start.
  config.model_kwargs = ml_collections.ConfigDict(dict(num_layers=2, embed_dim=64,
                                                       hidden_dim=128, num_heads=4, head_dim=16))
  config.warm_start_steps = 800
  config.warm_start_batch_size = 128
  config.warm_start_learning_rate = 3e-3
  # Method and SERA (docs/method.md#the-estimator-and-its-scale): each arm sets its method
  # and estimator; M = batch_size prompts a step, B = M * N0 rollouts.
  config.method = "sera"
  config.estimator = "maxrl"
  config.batch_size = 32
  config.baseline_n = 8
  config.n_min = 2
  config.n_max = 32
  config.rl_steps = 128
  config.align_every = 8  # alignment with the exact gradient every k RL steps
  # Each arm's Adam rate: the best validation pass@1 over tuning_seeds.
  config.learning_rates = (3e-4, 1e-3, 3e-3)
  config.tuning_seeds = (100,)
  # Evaluation: pass@k from this many samples a problem.
  config.validation_samples = 64
  config.eval_samples = 256
  config.lock()
  return config
