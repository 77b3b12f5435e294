"""Training outcome: held-out pass@k at the end of training, per method.

For each dataset config, ce (the exact cross-entropy gradient), sera, uniform,
equalized and the baseline allocators knapsack, gvm and adaptive
(sera_jax.method.allocators) train with the same rollout budget B = M * N0, the same
learning-rate schedule and the same seeds (model init, rollout sampling and
data order all follow config.seed); pass@k = mean_q 1 - (1 - p_q)^k
(k = 1, 2, ..., 1024) is evaluated once, on the held-out split after the last
step. Alignment is measured only at step 0 (align_every = num_steps), so the
runs pay for the method's own update only.

  sera-jax figure outcome      # 2 datasets x 7 methods x 3 seeds

Writes training_outcome.png (pass@k against k, mean and the band
of +-1 standard deviation over seeds, one panel per dataset) and
training_outcome.csv (mean, std and every seed's value) into --out, and one
`sera-jax train` workdir per run under
--workdir-root/<dataset>-<steps>steps/method=M,seed=S (named as `sera-jax
sweep` names them; a finished run is read back, not retrained).
"""

import os
import time

import numpy as np

from sera_jax.common import files
from sera_jax.common.plots import plt, save_figure
from sera_jax.harness import configs, sweep
from sera_jax.harness.figures import common
from sera_jax.settings.classification.task import PASS_AT_K

NAME = "training_outcome"
METHODS = ("ce", "sera", "uniform", "equalized", "knapsack", "gvm", "adaptive")
# Dataset name -> (shipped config, default steps). synthetic1000 gets more steps than its
# config's 400 because the RL methods are still far from their plateau at 400.
DATASETS = {"synthetic1000": ("synthetic1000", 1500), "digits": ("default", 500)}
COLORS = {"ce": "black", "sera": "tab:blue", "uniform": "tab:orange", "equalized": "tab:green",
          "knapsack": "tab:red", "gvm": "tab:purple", "adaptive": "tab:brown"}


def run_config(dataset: str, method: str, seed: int, num_steps: int):
  """The dataset's config with the method, seed and steps of one run, evaluated once at the end."""
  config = configs.load(DATASETS[dataset][0])
  config.update(dict(method=method, seed=seed, num_steps=num_steps, align_every=num_steps,
                     eval_every=num_steps, checkpoint_every=num_steps))
  return config


def train_all(datasets: dict[str, int], methods, seeds, workdir_root: str) -> dict:
  """pass@k of every (dataset, method) run: {(dataset, method): [[pass@k per k] per seed]}."""
  results = {}
  for dataset, num_steps in datasets.items():
    for method in methods:
      task = None
      for seed in seeds:
        config = run_config(dataset, method, seed, num_steps)
        overrides = (("method", method), ("seed", str(seed)))
        workdir = os.path.join(workdir_root, f"{dataset}-{num_steps}steps",
                               sweep.workdir_name(overrides))
        rows, task = common.train_or_read(config, workdir, task,
                                          label=f"{dataset} {method} seed {seed}")
        results.setdefault((dataset, method), []).append(
            [rows[-1][f"pass@{k}"] for k in PASS_AT_K])
  return results


def write_csv(results: dict, seeds, path: str) -> None:
  rows = [row for (dataset, method), per_seed in results.items()
          for row in common.per_seed_rows({"dataset": dataset, "method": method}, per_seed,
                                           seeds, PASS_AT_K, digits=6)]
  files.write_csv(path, rows)


def plot(results: dict, datasets: dict[str, int], seeds, path: str) -> None:
  fig, axes = plt.subplots(1, len(datasets), figsize=(5.5 * len(datasets), 4.2), squeeze=False)
  for axis, (dataset, num_steps) in zip(axes[0], datasets.items(), strict=True):
    for (name, method), per_seed in results.items():
      if name != dataset:
        continue
      values = np.asarray(per_seed)
      mean, std = values.mean(0), values.std(0)
      axis.plot(PASS_AT_K, mean, "o-", color=COLORS[method], label=method, markersize=3)
      axis.fill_between(PASS_AT_K, mean - std, mean + std, color=COLORS[method], alpha=0.2)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("k")
    axis.set_ylabel("held-out pass@k")
    axis.set_title(f"{dataset}, {num_steps} steps, {len(seeds)} seeds (mean ± std)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
  fig.tight_layout()
  save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> None:
  parser = common.figure_parser("outcome", __doc__)
  parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
  parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
  parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
  parser.add_argument("--num-steps", nargs="+", default=[], metavar="DATASET=STEPS",
                      help="Override a dataset's step count, e.g. digits=1000.")
  parser.add_argument("--workdir-root", default="runs/training_outcome")
  args = parser.parse_args(argv)
  steps = {name: DATASETS[name][1] for name in args.datasets}
  for spec in args.num_steps:
    name, _, value = spec.partition("=")
    if name not in steps or not value.isdigit() or int(value) < 1:
      parser.error(f"--num-steps takes DATASET=STEPS with DATASET in {list(steps)}; got {spec!r}")
    steps[name] = int(value)

  start = time.perf_counter()
  results = train_all(steps, args.methods, args.seeds, args.workdir_root)
  png, csv = common.output_paths(args.out, NAME)
  write_csv(results, args.seeds, csv)
  plot(results, steps, args.seeds, png)
  print(f"wrote {png} and {csv} in {time.perf_counter() - start:.0f} s")
  for (dataset, method), per_seed in results.items():
    values = np.asarray(per_seed)
    cells = [f"pass@{k} {values[:, PASS_AT_K.index(k)].mean():.4f} ± "
             f"{values[:, PASS_AT_K.index(k)].std():.4f}" for k in (1, 256)]
    print(f"{dataset:14s} {method:10s} " + "   ".join(cells))

