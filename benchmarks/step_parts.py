"""Where a batch of digits-MLP runs spends its step: each part alone, vmapped and one by one.

The default classification config's step (`sera_jax.settings.classification.task`) does
four kinds of work; each is timed here by itself, in one process, for R runs that differ in
their seed: as R calls of its jitted function (one run after another, as `sera-jax train`
runs them) and as one call of it vmapped over the runs (as a batch of runs,
`sera_jax.harness.batched`, runs it). The ratio is how much a batch gains on that part.

* forward + 5 backward passes: the network's forward pass and the vector-Jacobian
  products of the alignment step's five logit cotangents;
* the passes' matrix products alone: the same products of the same shapes (the layers'
  inputs by their kernels forward; each cotangent's kernel gradients and the deltas it
  sends back), without the biases and ReLUs, so the floor of the network's passes;
* SERA's allocation of the budget B = M N0 among the M prompts;
* SERA's allocation, its rollouts (up to n_max a prompt) and their logit cotangent;
* uniform MaxRL's N0 rollouts a prompt and their logit cotangent.

  python benchmarks/step_parts.py [--runs 10] [--repeats 200]
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from sera_jax.harness import configs
from sera_jax.method import allocation, registry
from sera_jax.settings.classification import allocations, gradients
from sera_jax.settings.classification.task import ClassificationTask


def _seconds(fn, repeats: int) -> float:
  """The best of three means of `repeats` calls of `fn`, each finished."""
  jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(3):
    start = time.perf_counter()
    for _ in range(repeats):
      out = fn()
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - start) / repeats)
  return best


def _parts(task: ClassificationTask):
  """{part: (function of one run's inputs, the names of the inputs it takes)}."""
  config = task.config
  modes = {mode: allocations.allocation_config(config, mode) for mode in ("sera", "uniform")}

  def backward(params, images, labels):
    forward = lambda p: task.model.apply(p, {}, images, train=True)  # noqa: E731
    logits, vjp_fn, _ = jax.vjp(forward, params, has_aux=True)
    exact = gradients.exact_logit_grad(logits, labels)
    return gradients.stacked_vjp(vjp_fn, [(i + 1.0) * exact for i in range(5)])

  def matmuls(params, images, labels):
    # The MLP's layers in order: dense0, dense1, ..., head.
    kernels = [params[name]["kernel"] for name in sorted(params)]
    inputs = [jnp.reshape(images, (images.shape[0], -1))]
    for kernel in kernels:
      inputs.append(inputs[-1] @ kernel)
    exact = gradients.exact_logit_grad(inputs.pop(), labels)
    products = []
    for shift in range(5):  # five distinct cotangents, so that no product is shared
      delta = jnp.roll(exact, shift, axis=-1)
      for layer in reversed(range(len(kernels))):
        products.append(inputs[layer].T @ delta)
        if layer:
          delta = delta @ kernels[layer].T
    return products

  def allocate(mode, logits, labels, key):
    return registry.allocate_with(modes[mode], allocations.inputs(modes[mode], logits, labels,
                                                                  key))

  def rollouts(mode, logits, labels, key):
    width = allocation.max_count(mode, baseline_n=config.baseline_n, n_max=config.n_max)
    return gradients.sample_and_score(key, logits, labels, allocate(mode, logits, labels, key),
                                      baseline_n=config.baseline_n,
                                      estimator=modes[mode].estimator_spec,
                                      max_rollouts=width)[0]

  return {
      "forward + 5 backward passes": (backward, ("params", "images", "labels")),
      "the passes' matrix products": (matmuls, ("params", "images", "labels")),
      "SERA allocation": (functools.partial(allocate, "sera"), ("logits", "labels", "key")),
      "SERA allocation + rollouts": (functools.partial(rollouts, "sera"),
                                     ("logits", "labels", "key")),
      "uniform rollouts": (functools.partial(rollouts, "uniform"), ("logits", "labels", "key")),
  }


def _inputs(task: ClassificationTask, runs: int) -> dict[str, object]:
  """Each input of the parts, stacked over R runs (run r: seed r's parameters and batch)."""
  per_run = []
  for seed in range(runs):
    state = task.init_state(jax.random.PRNGKey(seed))
    batch = task.dataset.train_batch(0, task.config.batch_size, seed)
    logits, _ = task.model.apply(state.params, {}, batch["image"], train=True)
    per_run.append({"params": state.params, "images": batch["image"], "labels": batch["label"],
                    "logits": logits, "key": jax.random.PRNGKey(seed)})
  return jax.tree.map(lambda *leaves: np.stack(leaves), *per_run)


def measure(runs: int, repeats: int) -> dict[str, tuple[float, float]]:
  """{part: (seconds of R runs one after another, seconds of them vmapped)}."""
  task = ClassificationTask(configs.load("default"))
  stacked = _inputs(task, runs)
  times = {}
  for name, (part, names) in _parts(task).items():
    args = [stacked[n] for n in names]
    alone, batched = jax.jit(part), jax.jit(jax.vmap(part))
    one_run_args = [[jax.tree.map(lambda x, r=r: x[r], a) for a in args] for r in range(runs)]
    times[name] = (
        _seconds(lambda alone=alone, runs_args=one_run_args: [alone(*run_args)
                                                             for run_args in runs_args],
                 repeats),
        _seconds(lambda batched=batched, args=args: batched(*args), repeats))
  return times


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=200)
  args = parser.parse_args(argv)
  print(f"{jax.devices()[0].platform}, R = {args.runs} runs of the default digits MLP config")
  print(f"{'part':<30} {'ms/run one by one':>18} {'ms/run batched':>15} {'ratio':>7}")
  for name, (alone, batched) in measure(args.runs, args.repeats).items():
    print(f"{name:<30} {1e3 * alone / args.runs:>18.3f} {1e3 * batched / args.runs:>15.3f} "
          f"{alone / batched:>7.2f}", flush=True)


if __name__ == "__main__":
  main()
