"""A classification batch that samples its rollouts in slices against the same batch vmapped.

On the CPU, `gradients.sample_and_score_in_slices` samples one run of a batch after another
inside the program where the batch's rollout slots (runs x M x the padded width) are more
than 2^18, and vmaps the sampling below. For R runs of each model (`benchmarks/sweep.py`'s
"mlp" and "small_cnn", and budget scaling's SERA runs "n0_16", "n0_128", "n0_1024"), this
builds the batch both ways, with the bound at 0 (in slices) and above every size (vmapped),
times --repeats rounds of --steps steps of each, back to back, and prints the median ms a
run's step each way and the median and range of the rounds' ratios vmapped / in slices.
On a GPU or TPU both ways are the same program: only the CPU's samples in slices.

  python benchmarks/sampling_slices.py [--models mlp n0_16 n0_128 n0_1024] [--runs 10]
                                       [--steps 10] [--repeats 5]
"""

import argparse
import statistics

import sweep

from sera_jax.method import allocation
from sera_jax.settings.classification import gradients
from sera_jax.settings.classification.batched import BatchedClassification

# The bound on a vmap's rollout slots above which the batch samples in slices.
WAYS = {"in slices": 0, "vmapped": 2**62}


def slots(model: str, runs: int) -> int:
  """The rollout slots of SERA's sampling in a batch of `runs` runs of `model`."""
  config = sweep._config(model, 0, 1)
  width = allocation.max_count("sera", baseline_n=config.baseline_n, n_max=config.n_max)
  return runs * config.batch_size * width


def measure(model: str, runs: int, steps: int, repeats: int) -> dict[str, list[float]]:
  """{way: the seconds of each round}, the first steps (compiling) left out."""
  programs = 1 if sweep._config(model, 0, steps).get("align_every", 1) == 1 else 2
  configs = [sweep._config(model, seed, programs + repeats * steps) for seed in range(runs)]
  batches = {}
  default_bound = gradients._SLICED_MIN_SLOTS
  try:
    for way, bound in WAYS.items():
      gradients._SLICED_MIN_SLOTS = bound  # read as the steps are traced, at their first call
      batch = BatchedClassification(configs)
      state, _ = sweep._train(batch.train_step, batch.init_state(), range(programs))
      batches[way] = (batch, state)
  finally:
    gradients._SLICED_MIN_SLOTS = default_bound
  rounds = {way: [] for way in WAYS}
  for round_ in range(repeats):
    steps_of_round = range(programs + round_ * steps, programs + (round_ + 1) * steps)
    for way, (batch, state) in batches.items():
      state, seconds = sweep._train(batch.train_step, state, steps_of_round)
      batches[way] = (batch, state)
      rounds[way].append(seconds)
  return rounds


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=["mlp", "n0_16", "n0_128", "n0_1024"])
  parser.add_argument("--runs", type=int, default=10)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=5, help="rounds of both ways")
  args = parser.parse_args(argv)
  print(f"R = {args.runs} runs, {args.repeats} rounds of {args.steps} steps; the bound in "
        f"use: {gradients._SLICED_MIN_SLOTS} slots")
  print(f"{'model':<10} {'slots':>10} {'ms in slices':>13} {'ms vmapped':>11} "
        f"{'vmapped / in slices':>20} {'range':>11}")
  for model in args.models:
    rounds = measure(model, args.runs, args.steps, args.repeats)
    ratios = [v / s for s, v in zip(rounds["in slices"], rounds["vmapped"], strict=True)]
    per_step = {way: 1e3 * statistics.median(seconds) / (args.runs * args.steps)
                for way, seconds in rounds.items()}
    print(f"{model:<10} {slots(model, args.runs):>10,} {per_step['in slices']:>13.2f} "
          f"{per_step['vmapped']:>11.2f} {statistics.median(ratios):>20.2f} "
          f"{min(ratios):>5.2f}-{max(ratios):<5.2f}", flush=True)


if __name__ == "__main__":
  main()
