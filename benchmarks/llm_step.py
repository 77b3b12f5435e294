"""SeraLearner's step over Tunix's stock GRPO learner's step at the same rollout budget.

Both train the tiny decoder of `sera_jax.settings.llm.tiny` (M = 4 prompts, N0 = 4, so
B = 16 rollouts a step): the stock `GRPOLearner` with the registered "maxrl" estimator,
and `SeraLearner` with SERA's allocation (uniform in its first epoch, SERA after).
Then the cost of alignment: SeraLearner on the arithmetic task (one-digit sums, the
same M, N0 and decoder) with and without the exact-gradient cosines every step.
A step's time is the interval between consecutive global steps (Tunix's metrics
callback), the median over the steps after the first two (compilation); the learners
alternate for several rounds in this process and each keeps its best round.

  python benchmarks/llm_step.py [--steps 14] [--rounds 3]
"""

import argparse
import itertools
import time

import jax
import numpy as np
import optax
from tunix.rl.grpo import grpo_learner

from sera_jax.settings.llm import arithmetic, tiny
from sera_jax.settings.llm import cluster as cluster_lib
from sera_jax.settings.llm import learner as sera_llm


def step_seconds(name: str, num_steps: int) -> float:
  """Median seconds between global steps of one fresh run of `name`: "stock" or "sera" on the
  tiny task, "unaligned" or "aligned" (every step) SeraLearner on the arithmetic task."""
  if name in ("stock", "sera"):
    cluster, data = tiny.cluster(num_steps), tiny.dataset(num_steps, tiny.BATCH_SIZE)
  else:
    problems = arithmetic.split({"train": tiny.DATASET_SIZE}, digits=1, seed=0)["train"]
    cluster = cluster_lib.build(tiny.decoder(0), arithmetic.TOKENIZER, tiny.mesh(),
                                optimizer=optax.adam(1e-3), max_steps=num_steps,
                                rollout_config=arithmetic.rollout_config(1))
    data = list(itertools.islice(sera_llm.epoch_batches(problems.columns(), tiny.BATCH_SIZE, 0),
                                 num_steps))
  if name == "stock":
    learner = grpo_learner.GRPOLearner(cluster, grpo_learner.GRPOConfig(
        num_generations=tiny.BASELINE_N, beta=0.0, advantage_estimator="maxrl",
        policy_loss_fn=sera_llm.BUDGET_NORM_LOSS, loss_agg_mode=sera_llm.TOKEN_SUM_NORM),
        tiny.slack_reward)
  else:
    exact = {} if name == "sera" else dict(exact_log_p=arithmetic.batch_log_p,
                                           align_every=int(name == "aligned"))
    learner = sera_llm.SeraLearner(cluster, sera_llm.SeraConfig(
        num_generations=tiny.BASELINE_N, n_max=tiny.N_MAX, dataset_size=tiny.DATASET_SIZE,
        **exact), tiny.slack_reward if name == "sera" else arithmetic.exact_reward)
  stamps = []
  cluster.with_external_metrics_logger(lambda buffer: stamps.append(time.perf_counter()))
  with jax.set_mesh(tiny.mesh()):
    learner.train(data)
  return float(np.median(np.diff(stamps[2:])))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=14)
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  start = time.perf_counter()
  best = dict.fromkeys(("stock", "sera", "unaligned", "aligned"), np.inf)
  for _ in range(args.rounds):
    for name in best:
      best[name] = min(best[name], step_seconds(name, args.steps))
  print(f"backend {jax.default_backend()}, {time.perf_counter() - start:.0f} s; "
        f"B = {tiny.BATCH_SIZE * tiny.BASELINE_N} rollouts a step")
  print(f"stock GRPOLearner step   {best['stock'] * 1e3:8.1f} ms")
  print(f"SeraLearner step         {best['sera'] * 1e3:8.1f} ms")
  print(f"SeraLearner / stock      {best['sera'] / best['stock']:8.3f}x  (target <= 1.05x)")
  print(f"arithmetic task, SeraLearner step          {best['unaligned'] * 1e3:8.1f} ms")
  print(f"  aligned with the exact gradient each step {best['aligned'] * 1e3:8.1f} ms "
        f"({best['aligned'] / best['unaligned']:.2f}x)")


if __name__ == "__main__":
  main()
