"""Cost of an alignment step and of a SERA training step over a cross-entropy step.

Each configuration builds five jitted steps (two candidates for ce) on the same model, batch and
optimizer and times them interleaved in this one process (best of several
rounds), so the printed ratios do not depend on the machine's load:

  ce           a plain cross-entropy step, the faster of value_and_grad + update
               and the task's own "ce" step (the exact cotangent through the VJP)
  alignment    exact, SERA and uniform cotangents (realized and expected)
               through one jax.vjp, plus both allocations (align_every = 1)
  sera         a SERA step without alignment (align_every > 1): allocation,
               sampling and one cotangent through the VJP
  gradients    the alignment step's floor: the same five gradients (five cotangents
               of one forward pass), their Gram matrix and the update, with no
               allocation, sampling or metrics

With a backward pass costing two forwards the gradients alone cost
(1 + 5 * 2) / (1 + 2) = 3.7x a cross-entropy step; on a model as small as the
default MLP, whose step is a tenth of a millisecond, fixed costs push that floor
higher (the `gradients` column shows it).

  python benchmarks/alignment_step.py [--models mlp resnet18] [--batch 64] [--rounds 5]
"""

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sera_jax.harness.configs.base import classification as base_config
from sera_jax.method.success import oracle_log_p
from sera_jax.settings.classification import gradients
from sera_jax.settings.classification.task import ClassificationTask, TrainState, make_train_step

MIN_ROUND_SECONDS = 0.05
MODEL_KWARGS = {"mlp": {}, "small_cnn": {}, "resnet18": {"small_inputs": True},
                "resnet50": {"small_inputs": True}}


def cross_entropy_step(model, optimizer):
  def step(state, images, labels, step):
    def loss_fn(params):
      logits, batch_stats = model.apply(params, state.batch_stats, images, train=True)
      return -jnp.mean(oracle_log_p(logits, labels)), batch_stats

    (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    return TrainState(optax.apply_updates(state.params, updates), batch_stats, opt_state,
                      state.rng), {"loss": loss}

  return jax.jit(step, donate_argnums=0)


def five_gradient_step(model, optimizer):
  """The gradients of five cotangents of one forward pass, their Gram matrix and an update."""
  def step(state, images, labels, step):
    forward = lambda p: model.apply(p, state.batch_stats, images, train=True)  # noqa: E731
    logits, vjp_fn, batch_stats = jax.vjp(forward, state.params, has_aux=True)
    exact = gradients.exact_logit_grad(logits, labels)
    (grads,) = gradients.stacked_vjp(vjp_fn, [exact * scale for scale in range(1, 6)])
    ascent = jax.tree.map(lambda g: -g[0], grads)
    updates, opt_state = optimizer.update(ascent, state.opt_state, state.params)
    return TrainState(optax.apply_updates(state.params, updates), batch_stats, opt_state,
                      state.rng), {"gram": gradients.gram_matrix(grads)}

  return jax.jit(step, donate_argnums=0)


def _time(fn, state, images, labels, repeats):
  start = time.perf_counter()
  for i in range(repeats):
    state, metrics = fn(state, images, labels, i)
  jax.block_until_ready((state, metrics))
  return (time.perf_counter() - start) / repeats, state


def measure(model_name: str, batch: int, rounds: int, repeats: int,
            dataset: str = "digits") -> dict[str, float]:
  config = base_config()
  config.update(model=model_name, batch_size=batch, dataset=dataset)
  config.model_kwargs = MODEL_KWARGS[model_name]
  task = ClassificationTask(config)
  ce_config = config.copy_and_resolve_references()
  ce_config.method = "ce"
  steps = {
      "ce_grad": cross_entropy_step(task.model, task.optimizer),
      "ce_vjp": make_train_step(task.model, task.optimizer, ce_config, align=False),
      "alignment": make_train_step(task.model, task.optimizer, config, align=True),
      "sera": make_train_step(task.model, task.optimizer, config, align=False),
      "gradients": five_gradient_step(task.model, task.optimizer),
  }
  images, labels = task._batch(0)
  states = {name: task.init_state(jax.random.PRNGKey(0)) for name in steps}
  best = dict.fromkeys(steps, np.inf)
  for name, fn in steps.items():  # compile and warm up
    _, states[name] = _time(fn, states[name], images, labels, 2)
  # Sub-millisecond steps are timed over at least MIN_ROUND_SECONDS a round, so that
  # dispatch jitter averages out.
  seconds, states["ce_grad"] = _time(steps["ce_grad"], states["ce_grad"], images, labels, 3)
  repeats = max(repeats, math.ceil(MIN_ROUND_SECONDS / seconds))
  for _ in range(rounds):
    for name, fn in steps.items():
      seconds, states[name] = _time(fn, states[name], images, labels, repeats)
      best[name] = min(best[name], seconds)
  best["ce"] = min(best.pop("ce_grad"), best.pop("ce_vjp"))
  return best


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=["mlp", "resnet18"])
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  print(f"backend {jax.default_backend()}, {jax.device_count()} device(s), batch {args.batch}, "
        f"N0 = 8, n_max = 32")
  print(f"{'model':<10} {'ce ms':>9} {'align ms':>9} {'sera ms':>9} {'align/ce':>9} "
        f"{'sera/ce':>8} {'floor/ce':>9}")
  for model_name in args.models:
    best = measure(model_name, args.batch, args.rounds, args.repeats)
    print(f"{model_name:<10} {best['ce'] * 1e3:9.2f} {best['alignment'] * 1e3:9.2f} "
          f"{best['sera'] * 1e3:9.2f} {best['alignment'] / best['ce']:8.2f}x "
          f"{best['sera'] / best['ce']:7.2f}x {best['gradients'] / best['ce']:8.2f}x")


if __name__ == "__main__":
  main()
