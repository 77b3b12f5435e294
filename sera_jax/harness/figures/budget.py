"""Alignment with the exact gradient versus the rollout budget.

Trains one run (default: the shipped config `default` with method ce, the
exact gradient, so the snapshots favour none of the compared estimators),
checkpointed at every epoch, and for its early, midway and late snapshots and
one fixed batch of M training prompts sweeps N0 (n_min = 2, n_max = 4 N0).
For uniform MaxRL, "equalized" (every prompt active), SERA and the baseline
allocators at the same budget (Knapsack-RL, GVM-RAFT with the exact gradient
norms, adaptive sampling; sera_jax.method.allocators) it reports the cosine of
the expected gradient with the exact one (adaptive sampling's by Monte Carlo:
its counts depend on its rollouts' outcomes), and the mean cosine of the
realized gradient over --seeds sampling seeds with a 95% Student-t interval.
Every (N0, snapshot) point is one jitted call: all seeds of all methods are
sampled under one vmap and pushed through one VJP
(sera_jax.settings.classification.alignment).

  sera-jax figure budget          # or: python experiments/alignment_vs_budget.py

Writes alignment_vs_budget.png and alignment_vs_budget.csv into --out
(default docs/figures) and prints the tables.
"""

import sys

import jax
import numpy as np

from sera_jax.common import files
from sera_jax.common.plots import plt, save_figure
from sera_jax.harness.figures import common
from sera_jax.settings.classification import alignment

NAME = "alignment_vs_budget"
CPU_COST = "about 1 min, training its run"  # on a 2-core CPU (`sera-jax figure --list`)
METHODS = (("uniform", "tab:orange"), ("equalized", "tab:green"), ("sera", "tab:blue"),
           ("knapsack", "tab:red"), ("gvm", "tab:purple"), ("adaptive", "tab:brown"))
BASELINES = (2, 4, 8, 16, 32, 64, 128)


def sweep(task, workdir, snapshots, baselines, num_seeds, *, n_min=2, n_max_factor=4):
  """Rows of (snapshot, N0, method) with expected and realized cosines."""
  batch = common.evaluation_batches(task.dataset, task.config.batch_size, 1)[0]
  states = {name: common.load_state(task, workdir, step) for name, step in snapshots.items()}
  keys = alignment.seed_keys(task.config.seed, num_seeds)
  rows = []
  for baseline_n in baselines:
    methods = {mode: alignment.oracle_method(baseline_n=baseline_n, n_min=n_min,
                                           n_max=n_max_factor * baseline_n, mode=mode)
               for mode, _ in METHODS}
    evaluate = alignment.make_evaluator(task, methods)
    for snapshot, state in states.items():
      results = jax.device_get(evaluate(state, batch.images, batch.labels, keys))
      for mode, _ in METHODS:
        result = results[mode]
        mean, half = common.mean_interval(result.realized)
        rows.append({
            "snapshot": snapshot, "step": snapshots[snapshot], "N0": baseline_n,
            "n_max": n_max_factor * baseline_n, "method": mode,
            "expected_cos": float(result.expected[0]), "realized_cos_mean": float(mean),
            "realized_cos_ci95_low": float(mean - half),
            "realized_cos_ci95_high": float(mean + half),
            "realized_cos_std": float(np.std(result.realized, ddof=1)), "num_seeds": num_seeds,
            "active_fraction": float(result.active_fraction[0]),
            "expected_norm_ratio": float(result.norm_ratio[0]),
        })
  return rows


def plot(rows, snapshots, path):
  fig, axes = plt.subplots(1, len(snapshots), figsize=(4.2 * len(snapshots), 4), sharey=True,
                           squeeze=False)
  for axis, (snapshot, step) in zip(axes[0], snapshots.items(), strict=True):
    offsets = np.linspace(0.9, 1.1, len(METHODS))
    for offset, (mode, color) in zip(offsets, METHODS, strict=True):
      points = [r for r in rows if r["snapshot"] == snapshot and r["method"] == mode]
      budgets = [r["N0"] for r in points]
      axis.plot(budgets, [r["expected_cos"] for r in points], "-o", color=color, markersize=4,
                label=f"{mode} expected")
      realized = np.array([r["realized_cos_mean"] for r in points])
      errors = np.array([[r["realized_cos_mean"] - r["realized_cos_ci95_low"],
                          r["realized_cos_ci95_high"] - r["realized_cos_mean"]] for r in points]).T
      # Realized points are nudged sideways so coinciding methods stay visible.
      axis.errorbar(np.array(budgets) * offset, realized, yerr=errors, fmt="--s", color=color,
                    markersize=4, capsize=3, label=f"{mode} realized (95% CI)")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("N0 (budget M N0; n_max = 4 N0)")
    axis.set_title(f"{snapshot} snapshot (step {step})")
    axis.grid(alpha=0.3)
  axes[0, 0].set_ylabel("cosine with the exact gradient")
  axes[0, -1].legend(fontsize=7, loc="lower right")
  fig.tight_layout()
  save_figure(fig, path, dpi=120)


def tables(rows, snapshots) -> str:
  """Per snapshot and averaged over snapshots: realized mean [CI] and expected, by N0 and method."""
  modes = [mode for mode, _ in METHODS]
  header = ["N0", *[f"{m} realized" for m in modes], *[f"{m} expected" for m in modes]]
  out = []
  for snapshot in [*snapshots, "mean over snapshots"]:
    table = []
    for baseline_n in sorted({r["N0"] for r in rows}):
      cell = {}
      for mode in modes:
        points = [r for r in rows if r["N0"] == baseline_n and r["method"] == mode
                  and snapshot in (r["snapshot"], "mean over snapshots")]
        realized = np.mean([r["realized_cos_mean"] for r in points])
        if len(points) == 1:
          cell[f"{mode} realized"] = (f"{realized:.4f} [{points[0]['realized_cos_ci95_low']:.4f}, "
                                      f"{points[0]['realized_cos_ci95_high']:.4f}]")
        else:
          cell[f"{mode} realized"] = f"{realized:.4f}"
        cell[f"{mode} expected"] = float(np.mean([r["expected_cos"] for r in points]))
      table.append([baseline_n, *[cell[h] for h in header[1:]]])
    out.append(f"{snapshot}:\n" + common.format_table(header, table))
  return "\n\n".join(out)


def main(argv=None):
  parser = common.figure_parser("budget", __doc__)
  common.add_run_arguments(parser, seeds=16)
  parser.add_argument("--baselines", type=int, nargs="+", default=list(BASELINES),
                      help="N0 values of the sweep")
  argv = sys.argv[1:] if argv is None else argv
  args = parser.parse_args(argv)
  if args.seeds < 2:
    parser.error("--seeds must be >= 2 for an interval")
  figure_run = common.start_figure()
  task, workdir, snapshots = common.prepare_run(args)
  rows = sweep(task, workdir, snapshots, args.baselines, args.seeds)
  png, csv = common.output_paths(args.out, NAME)
  files.write_csv(csv, rows)
  plot(rows, snapshots, png)
  print(tables(rows, snapshots))
  manifest = common.write_manifest(
      args.out, NAME, figure_run, command="figure budget", argv=argv, seeds=list(range(args.seeds)),
      tuning_seeds=[],
      protocol=common.snapshot_protocol(args, task, snapshots, baselines=args.baselines))
  print(f"\nwrote {png}, {csv} and {manifest} in {figure_run.elapsed():.0f} s")
  return rows

