"""Optimizers and learning-rate schedules from a config (optax)."""

import ml_collections
import optax

from sera_jax.method import validation

OPTIMIZERS = ("sgd", "adam")
SCHEDULES = ("constant", "cosine")


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warm-up over `warmup_steps`, then constant or cosine decay to 0."""
  validation.choice("config.schedule", config.schedule, SCHEDULES)
  validation.real("config.learning_rate", config.learning_rate, positive=True)
  validation.integer("config.warmup_steps", config.warmup_steps, minimum=0)
  if config.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.learning_rate,
        warmup_steps=config.warmup_steps,
        decay_steps=max(config.num_steps, config.warmup_steps + 1))
  return optax.join_schedules(
      [optax.linear_schedule(0.0, config.learning_rate, max(config.warmup_steps, 1)),
       optax.constant_schedule(config.learning_rate)], [config.warmup_steps])


def make_optimizer(config: ml_collections.ConfigDict,
                   schedule: optax.Schedule | None = None) -> optax.GradientTransformation:
  """SGD with momentum and decoupled L2 (the ImageNet protocol), or AdamW.

  Reads config.optimizer, momentum and weight_decay, and unless a `schedule` is
  given, learning_rate, schedule, warmup_steps and num_steps.
  """
  validation.choice("config.optimizer", config.optimizer, OPTIMIZERS)
  validation.real("config.weight_decay", config.weight_decay, minimum=0.0)
  if config.optimizer == "sgd":
    validation.real("config.momentum", config.momentum, minimum=0.0, below=1.0)
  if schedule is None:
    schedule = learning_rate_schedule(config)
  momentum = (config.momentum or None) if config.optimizer == "sgd" else None  # adamw has none
  return optimizer_chain(config.optimizer, schedule, momentum=momentum,
                         weight_decay=config.weight_decay)


def optimizer_chain(name: str, learning_rate, *, momentum,
                    weight_decay) -> optax.GradientTransformation:
  """`make_optimizer`'s transformation from values that may be traced, unchecked.

  `optax.inject_hyperparams` builds it from per-run arrays (a batch of runs,
  `sera_jax.settings.classification.batched`). A momentum of None skips the trace; a
  momentum of 0 keeps one that adds 0 * trace, the same update.
  """
  if name == "sgd":
    return optax.chain(optax.add_decayed_weights(weight_decay),
                       optax.sgd(learning_rate, momentum=momentum, nesterov=False))
  return optax.adamw(learning_rate, weight_decay=weight_decay)
