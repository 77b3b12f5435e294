"""Training outcome: held-out pass@k at the end of training, per method, each at its own
learning rate.

For each dataset config, ce (the exact cross-entropy gradient), sera, uniform,
equalized and the baseline allocators knapsack, gvm and adaptive
(sera_jax.method.allocators) train with the same rollout budget B = M * N0, the same
learning-rate schedule and the same seeds (model init, rollout sampling and
data order all follow config.seed). Each (dataset, method) trains a tuning
seed (100, never reported: the run that wins the choice would report a held-out
score biased by its luck) at every rate of the dataset's grid, keeps the rate of
the best final pass@1 on a validation split (digits: 300 images taken out of the
training images; synthetic1000: 5000 fresh examples of its classes), and trains
the reported seeds at it. pass@k = mean_q 1 - (1 - p_q)^k (k = 1, 2, ..., 1024) is
evaluated once, on the held-out split after the last step; the held-out split
plays no part in the choice. Alignment is measured only at step 0
(align_every = num_steps), so the runs pay for the method's own update only.

  sera-jax figure outcome      # 2 datasets x 7 methods x 4 rates, 3 seeds

Writes training_outcome.png (pass@k against k at the chosen rates, mean and
the band of +-1 standard deviation over seeds, one panel per dataset; beneath,
the final validation pass@1 against the rate) and training_outcome.csv (mean,
std and every seed's value) and training_outcome_rates.csv (the whole grid)
into --out, and one `sera-jax train` workdir per run under
--workdir-root/<dataset>-<steps>steps/method=M,lr=R,seed=S (named as `sera-jax
sweep` names them; a finished run of the same config is read back, one of
another config stops the figure). Each (dataset, method)'s tuning runs train as
one program, its reported seeds as another (`sera-jax sweep`'s batches, their
checkpoints in a batch-* directory beside the runs).
"""

import os
import sys
from typing import NamedTuple

import numpy as np

from sera_jax.common import files
from sera_jax.common.plots import plt, save_figure
from sera_jax.harness import configs, sweep
from sera_jax.harness.figures import common
from sera_jax.settings.classification.task import PASS_AT_K

NAME = "training_outcome"
CPU_COST = "about 30 min"  # on a 2-core CPU (`sera-jax figure --list`)
RATES_NAME = "training_outcome_rates"
TUNING_SEEDS = common.tuning_seeds(1)  # choose the rates; never reported
METHODS = ("ce", "sera", "uniform", "equalized", "knapsack", "gvm", "adaptive")


class Dataset(NamedTuple):
  config: str  # the shipped config
  num_steps: int  # default steps
  learning_rates: tuple[float, ...]  # the grid, around the config's own rate
  num_validation: int  # validation examples


# synthetic1000 gets more steps than its config's 400 because the RL methods are still far from
# their plateau at 400.
DATASETS = {"synthetic1000": Dataset("synthetic1000", 1500, (0.025, 0.05, 0.1, 0.2), 5000),
            "digits": Dataset("default", 500, (0.003, 0.01, 0.03, 0.1), 300)}
COLORS = {"ce": "black", "sera": "tab:blue", "uniform": "tab:orange", "equalized": "tab:green",
          "knapsack": "tab:red", "gvm": "tab:purple", "adaptive": "tab:brown"}


def run_config(dataset: str, method: str, seed: int, num_steps: int, learning_rate: float):
  """The dataset's config with the method, seed, rate and steps of one run, evaluated once at
  the end (held-out and validation)."""
  config = configs.load(DATASETS[dataset].config)
  config.update(dict(method=method, seed=seed, num_steps=num_steps, align_every=num_steps,
                     eval_every=num_steps, checkpoint_every=num_steps,
                     learning_rate=learning_rate))
  return common.with_validation_split(config, DATASETS[dataset].num_validation)


def train_all(datasets: dict[str, int], methods, seeds, workdir_root: str,
              learning_rates: dict[str, tuple[float, ...]], one_by_one: bool = False) -> dict:
  """{(dataset, method): common.TunedRuns} whose runs are the last metric row of a run."""
  results = {}
  for dataset, num_steps in datasets.items():
    for method in methods:
      def train_grid(points, dataset=dataset, num_steps=num_steps, method=method):
        workdirs = [os.path.join(workdir_root, f"{dataset}-{num_steps}steps", sweep.workdir_name(
            (("method", method), ("lr", f"{rate:g}"), ("seed", str(seed)))))
            for rate, seed in points]
        runs = common.train_or_read_batch(
            [run_config(dataset, method, seed, num_steps, rate) for rate, seed in points],
            workdirs, [f"{dataset} {method} lr {rate:g} seed {seed}" for rate, seed in points],
            one_by_one=one_by_one)
        return [run.rows[-1] if run.stopped_at is None else common.nan_scores(PASS_AT_K)
                for run in runs]

      tuned = common.tune_then_repeat(train_grid, learning_rates[dataset], seeds,
                                      lambda row: row["validation/pass@1"],
                                      tuning_seeds=TUNING_SEEDS)
      common.print_choice(f"{dataset} {method}", "pass@1", tuned)
      results[dataset, method] = tuned
  return results


def _pass_at_k(tuned: common.TunedRuns, seeds) -> np.ndarray:
  """[S, K] held-out pass@k of every seed at the chosen rate."""
  return np.array([[tuned.runs[seed][f"pass@{k}"] for k in PASS_AT_K] for seed in seeds])


def write_csv(results: dict, seeds, path: str) -> None:
  rows = [row for (dataset, method), tuned in results.items()
          for row in common.per_seed_rows(
              {"dataset": dataset, "method": method, "learning_rate": tuned.rate},
              _pass_at_k(tuned, seeds), seeds, PASS_AT_K, digits=6)]
  files.write_csv(path, rows)


def write_rates_csv(results: dict, path: str) -> None:
  """The whole grid: the tuning seed's final validation and held-out pass@1 and pass@256."""
  files.write_csv(path, [
      {"dataset": dataset, "method": method, "learning_rate": rate, "seed": seed,
       "chosen": rate == tuned.rate,
       **{f"{split}pass@{k}": f"{row[f'{prefix}pass@{k}']:.6f}" for k in (1, 256)
          for split, prefix in (("validation_", "validation/"), ("held_out_", ""))}}
      for (dataset, method), tuned in results.items()
      for (rate, seed), row in common.grid_runs(tuned)])


def plot(results: dict, datasets: dict[str, int], seeds, path: str) -> None:
  fig, axes = plt.subplots(2, len(datasets), figsize=(5.5 * len(datasets), 8), squeeze=False)
  for (top, bottom), (dataset, num_steps) in zip(axes.T, datasets.items(), strict=True):
    for (name, method), tuned in results.items():
      if name != dataset:
        continue
      values = _pass_at_k(tuned, seeds)
      mean, std = values.mean(0), values.std(0)
      top.plot(PASS_AT_K, mean, "o-", color=COLORS[method], markersize=3,
               label=f"{method} (lr {tuned.rate:g})")
      top.fill_between(PASS_AT_K, mean - std, mean + std, color=COLORS[method], alpha=0.2)
      common.plot_rate_sensitivity(bottom, tuned, label=method, color=COLORS[method])
    top.set_xscale("log", base=2)
    top.set_xlabel("k")
    top.set_ylabel("held-out pass@k")
    top.set_title(f"{dataset}, {num_steps} steps, {len(seeds)} seeds (mean ± std)")
    top.grid(alpha=0.3)
    top.legend(fontsize=8)
    bottom.set_ylabel("final validation pass@1 (tuning seed)")
    bottom.set_title(f"{dataset}: each method's rate (star: chosen)")
    bottom.legend(fontsize=7)
  fig.tight_layout()
  save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> None:
  parser = common.figure_parser("outcome", __doc__)
  parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
  parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
  parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2],
                      help="the reported seeds (the tuning seed 100 chooses the rates)")
  parser.add_argument("--num-steps", nargs="+", default=[], metavar="DATASET=STEPS",
                      help="Override a dataset's step count, e.g. digits=1000.")
  parser.add_argument("--learning-rates", nargs="+", type=float,
                      help="one grid for every dataset (default: each dataset's own, "
                      + "; ".join(f"{name} {list(d.learning_rates)}" for name, d in
                                  DATASETS.items()) + ")")
  parser.add_argument("--workdir-root", default="runs/training_outcome")
  common.add_one_by_one(parser)
  argv = sys.argv[1:] if argv is None else argv
  args = parser.parse_args(argv)
  steps = {name: DATASETS[name].num_steps for name in args.datasets}
  for spec in args.num_steps:
    name, _, value = spec.partition("=")
    if name not in steps or not value.isdigit() or int(value) < 1:
      parser.error(f"--num-steps takes DATASET=STEPS with DATASET in {list(steps)}; got {spec!r}")
    steps[name] = int(value)
  common.check_reported_seeds(parser, args.seeds, TUNING_SEEDS)
  if args.learning_rates and not all(rate > 0 for rate in args.learning_rates):
    parser.error("every learning rate must be > 0")
  rates = {name: tuple(sorted(set(args.learning_rates or DATASETS[name].learning_rates)))
           for name in steps}

  figure_run = common.start_figure()
  results = train_all(steps, args.methods, args.seeds, args.workdir_root, rates, args.one_by_one)
  png, csv = common.output_paths(args.out, NAME)
  _, rates_csv = common.output_paths(args.out, RATES_NAME)
  write_csv(results, args.seeds, csv)
  write_rates_csv(results, rates_csv)
  plot(results, steps, args.seeds, png)
  manifest = common.write_manifest(
      args.out, NAME, figure_run, command="figure outcome", argv=argv, seeds=args.seeds,
      tuning_seeds=TUNING_SEEDS,
      protocol={"num_steps": steps, "learning_rates": common.rate_choices(results)})
  print(f"wrote {png}, {csv}, {rates_csv} and {manifest} in "
        f"{figure_run.elapsed():.0f} s")
  for (dataset, method), tuned in results.items():
    values = _pass_at_k(tuned, args.seeds)
    cells = [f"pass@{k} {values[:, PASS_AT_K.index(k)].mean():.4f} ± "
             f"{values[:, PASS_AT_K.index(k)].std():.4f}" for k in (1, 256)]
    print(f"{dataset:14s} {method:10s} lr {tuned.rate:<6g}" + "   ".join(cells))
