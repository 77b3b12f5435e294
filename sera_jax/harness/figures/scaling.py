"""Budget scaling from the cold start: held-out pass@k against N0 for CE, uniform MaxRL and SERA,
each at its own learning rate.

The CPU stand-in of MaxRL's ImageNet figure (ResNet-50 from scratch with
K = 16, 128, 1024 rollouts a prompt): `synthetic1000` (1000 generated classes,
p ~ 1/1000 at the start) trained with uniform MaxRL and SERA at N0 in
{16, 128, 1024} (n_max = 4 N0, n_min = 2), and with cross-entropy (the exact
gradient, which uses no rollouts: one run per seed, drawn in every panel), all
with the same step count and schedule (SGD, momentum 0.9, cosine) and the same
seeds. `sera_rho` is SERA with normalize_by_rho=True (its step rescaled by
1 / mean coverage).

Every (method, N0) trains at its own learning rate: a tuning seed (100, never
reported: the run that wins the choice would report a held-out score biased by
its luck) trains at every rate of --learning-rates, the rate of the best final
pass@1 on a validation split (5000 fresh examples of the training classes,
disjoint from the held-out split) is chosen, and the reported seeds train at it. Held-out
pass@1 and pass@256 (exact: mean_q 1 - (1 - p_q)^k) are evaluated every
`--eval-every` steps; the held-out split plays no part in the choice.

  sera-jax figure scaling        # 3 N0 x (uniform, sera, sera_rho) + ce, 4 rates, 10 seeds

Writes budget_scaling.png (pass@1 and pass@256 over training per N0 at the
chosen rates, mean and +-1 std over seeds; final pass@k against N0; the paired
SERA - uniform difference with its 95% interval), budget_scaling.csv (every
seed's held-out pass@1 and pass@256 at every evaluation, at the chosen rates),
budget_scaling_rates.png (final validation pass@1 against the rate, per N0)
and budget_scaling_rates.csv (the whole grid) into --out, and one `sera-jax
train` workdir per run under --workdir-root (a finished run of the same config
is read back; one of another config stops the figure). Each (method, N0)'s
tuning runs train as one program, its reported seeds as another (`sera-jax
sweep`'s batches, their checkpoints in a batch-* directory beside the runs); a
run that diverges stops there while the others go on.
"""

import os
import sys

import numpy as np

from sera_jax.common import files
from sera_jax.common.plots import plt, save_figure
from sera_jax.harness import configs, sweep
from sera_jax.harness.figures import common

NAME = "budget_scaling"
CPU_COST = "about 1 h 40 min"  # on a 2-core CPU (`sera-jax figure --list`)
RATES_NAME = "budget_scaling_rates"
TUNING_SEEDS = common.tuning_seeds(1)  # choose the rates; never reported
BASELINES = (16, 128, 1024)
LEARNING_RATES = (0.025, 0.05, 0.1, 0.2)
VALIDATION_EXAMPLES = 5000
# Method name -> the config keys it sets; ce ignores N0 and runs once per seed.
METHODS = {"ce": dict(method="ce"), "uniform": dict(method="uniform"),
           "sera": dict(method="sera"), "sera_rho": dict(method="sera", normalize_by_rho=True)}
COLORS = {"ce": "black", "uniform": "tab:orange", "sera": "tab:blue", "sera_rho": "tab:cyan"}
KS = (1, 256)
# A curve whose seed-mean held-out pass@1 rose by more than this over the last quarter of the
# steps is reported as still rising.
RISING = 0.01


def run_config(method: str, baseline_n: int, seed: int, num_steps: int, eval_every: int,
               learning_rate: float):
  """synthetic1000 with the method, N0 (n_max = 4 N0), seed, rate and schedule of one run."""
  config = configs.load("synthetic1000")
  config.update(dict(baseline_n=baseline_n, n_max=4 * baseline_n, seed=seed,
                     num_steps=num_steps, eval_every=eval_every, align_every=num_steps,
                     checkpoint_every=num_steps, learning_rate=learning_rate,
                     **METHODS[method]))
  return common.with_validation_split(config, VALIDATION_EXAMPLES)


def _curves(rows, diverged) -> dict:
  """A run's held-out curves and its final validation scores (NaN when it diverged)."""
  evaluated = [row for row in rows if "pass@1" in row]
  curves = {"step": [row["step"] + 1 for row in evaluated], "diverged": diverged}  # steps trained
  curves |= {f"pass@{k}": [row[f"pass@{k}"] for row in evaluated] for k in KS}
  curves |= {f"validation/pass@{k}": np.nan if diverged is not None
             else evaluated[-1][f"validation/pass@{k}"] for k in KS}
  return curves


def train_all(methods, baselines, seeds, learning_rates, num_steps, eval_every, workdir_root,
              one_by_one=False):
  """{(method, N0): common.TunedRuns} whose runs are {"step": [...], "pass@1": [...],
  "pass@256": [...], "validation/pass@k": final value, "diverged"}, where step counts the
  steps trained before each evaluation and "diverged" is the step whose update went
  non-finite (the run stops there; None if it finished)."""
  results = {}
  for method in methods:
    for baseline_n in ([None] if method == "ce" else baselines):
      group = method if baseline_n is None else f"N0={baseline_n}"

      def train_grid(points, method=method, baseline_n=baseline_n, group=group):
        # ce samples no rollouts: its N0 is irrelevant, so it runs once, at the smallest.
        workdirs = [os.path.join(workdir_root, f"{num_steps}steps", group, sweep.workdir_name(
            [("method", method), ("lr", f"{rate:g}"), ("seed", str(seed))]))
            for rate, seed in points]
        labels = [f"{method} {'' if baseline_n is None else group + ' '}lr {rate:g} seed {seed}"
                  for rate, seed in points]
        runs = common.train_or_read_batch(
            [run_config(method, baseline_n or min(baselines), seed, num_steps, eval_every, rate)
             for rate, seed in points], workdirs, labels, one_by_one=one_by_one)
        for label, run in zip(labels, runs, strict=True):
          if run.stopped_at is not None:  # a result: kept up to the step that failed
            print(f"{label}: diverged at step {run.stopped_at}", flush=True)
        return [_curves(run.rows, run.stopped_at) for run in runs]

      tuned = common.tune_then_repeat(train_grid, learning_rates, seeds,
                                      lambda run: run["validation/pass@1"],
                                      tuning_seeds=TUNING_SEEDS)
      common.print_choice(f"{method} {group}", "pass@1", tuned)
      for n0 in (baselines if baseline_n is None else [baseline_n]):
        results[method, n0] = tuned
  return results


def final(results, method, baseline_n, seeds, k) -> np.ndarray:
  """[S] the last evaluation's held-out pass@k of every seed at the chosen rate; NaN for a run
  that diverged."""
  runs = [results[method, baseline_n].runs[s] for s in seeds]
  return np.array([np.nan if run["diverged"] is not None else run[f"pass@{k}"][-1]
                   for run in runs])


def _padded(curves, seeds, name) -> tuple[np.ndarray, np.ndarray]:
  """(steps, [S, steps] values) over the longest run, NaN where a diverged run stopped."""
  steps = max((curves[s]["step"] for s in seeds), key=len)
  values = np.full((len(seeds), len(steps)), np.nan)
  for row, seed in enumerate(seeds):
    values[row, :len(curves[seed][name])] = curves[seed][name]
  return np.asarray(steps), values


def rise_over_last_quarter(curves, seeds, k: int = 1) -> float:
  """The seed-mean held-out pass@k at the end minus at the evaluation nearest 3/4 of the steps
  (NaN when a seed diverged)."""
  steps, values = _padded(curves, seeds, f"pass@{k}")
  quarter = int(np.argmin(np.abs(steps - 0.75 * steps[-1])))
  return float(np.mean(values[:, -1] - values[:, quarter]))


def write_csv(results, seeds, path) -> None:
  """Every seed's held-out curves at the chosen rates."""
  rows = []
  for (method, baseline_n), tuned in results.items():
    for seed in seeds:
      curves = tuned.runs[seed]
      for i, step in enumerate(curves["step"]):
        rows.append({"N0": baseline_n, "method": method, "learning_rate": tuned.rate,
                     "seed": seed, "step": step,
                     **{f"pass@{k}": f"{curves[f'pass@{k}'][i]:.6f}" for k in KS},
                     "diverged_at_step": "" if curves["diverged"] is None
                     else curves["diverged"]})
  files.write_csv(path, rows)


def write_rates_csv(results, path) -> None:
  """The whole grid: the tuning seed's final validation and held-out pass@k at every rate."""
  rows, written = [], set()
  for (method, baseline_n), tuned in results.items():
    if id(tuned) in written:  # ce: one search, drawn at every N0
      continue
    written.add(id(tuned))
    for (rate, seed), curves in common.grid_runs(tuned):
      finished = curves["diverged"] is None
      rows.append({"N0": "" if method == "ce" else baseline_n, "method": method,
                   "learning_rate": rate, "seed": seed, "chosen": rate == tuned.rate,
                   **{f"validation_pass@{k}": f"{curves[f'validation/pass@{k}']:.6f}"
                      for k in KS},
                   **{f"held_out_pass@{k}": f"{curves[f'pass@{k}'][-1]:.6f}" if finished
                      else "" for k in KS},
                   "diverged_at_step": "" if finished else curves["diverged"]})
  files.write_csv(path, rows)


def plot_rates(results, methods, baselines, path) -> None:
  """Final validation pass@1 against the learning rate, one panel per N0."""
  fig, axes = plt.subplots(1, len(baselines), figsize=(4.6 * len(baselines), 3.8), squeeze=False)
  for axis, baseline_n in zip(axes[0], baselines, strict=True):
    for method in methods:
      tuned = results[method, baseline_n]
      common.plot_rate_sensitivity(axis, tuned, label=method, color=COLORS[method],
                                   linestyle="--" if method == "ce" else "-")
    axis.set(title=f"N0 = {baseline_n}", ylabel="final validation pass@1 (tuning seed)",
             ylim=(-0.02, 1.02))
    axis.legend(fontsize=8)
  fig.suptitle("synthetic1000: the learning rate of each method and N0 (star: chosen; a "
               "missing point diverged)", fontsize=10)
  fig.tight_layout()
  save_figure(fig, path, dpi=110)


def plot(results, methods, baselines, seeds, num_steps, path) -> None:
  columns = max(len(baselines), 3)  # the last row: final pass@1, pass@256, paired difference
  fig, axes = plt.subplots(3, columns, figsize=(4.6 * columns, 11), squeeze=False)
  for axis in axes[:2, len(baselines):].ravel():
    axis.set_visible(False)
  for axis in axes[2, 3:]:
    axis.set_visible(False)
  for row, k in enumerate(KS):
    for axis, baseline_n in zip(axes[row], baselines, strict=False):
      for method in methods:
        tuned = results[method, baseline_n]
        curves = tuned.runs
        steps, values = _padded(curves, seeds, f"pass@{k}")
        if not steps.size:
          continue
        with np.errstate(invalid="ignore"):  # a step no seed reached: a gap in the curve
          mean, std = np.nanmean(values, 0), np.nanstd(values, 0)
        diverged = [s for s in seeds if curves[s]["diverged"] is not None]
        label = f"{method} (lr {tuned.rate:g})" + (f", seeds {diverged} diverged"
                                                   if diverged else "")
        axis.plot(steps, mean, color=COLORS[method], label=label,
                  linestyle="--" if method == "ce" else "-")
        axis.fill_between(steps, mean - std, mean + std, color=COLORS[method], alpha=0.15)
      axis.set(title=f"N0 = {baseline_n} (n_max = {4 * baseline_n})", xlabel="step",
               ylabel=f"held-out pass@{k}", ylim=(-0.02, 1.02))
      axis.grid(alpha=0.3)
  for axis in axes[0, :len(baselines)]:
    axis.legend(fontsize=7)
  for axis, k in zip(axes[2][:2], KS, strict=True):
    for method in methods:
      values = np.array([final(results, method, n0, seeds, k) for n0 in baselines])
      axis.errorbar(baselines, values.mean(1), yerr=values.std(1), marker="o", capsize=3,
                    color=COLORS[method], label=method)
    axis.set(xscale="log", xlabel="N0 (rollouts a prompt on average)",
             ylabel=f"final held-out pass@{k}", ylim=(-0.02, 1.02))
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
  paired = axes[2][2]
  if {"sera", "uniform"} <= set(methods):
    for k, marker in zip(KS, ("o", "s"), strict=True):
      diffs = np.array([final(results, "sera", n0, seeds, k) - final(results, "uniform", n0,
                                                                        seeds, k)
                        for n0 in baselines])
      mean, half = common.mean_interval(diffs, axis=1)
      paired.errorbar(baselines, mean, yerr=half, marker=marker, capsize=3,
                      label=f"pass@{k}")
  paired.axhline(0.0, color="black", linewidth=0.8)
  paired.set(xscale="log", xlabel="N0", ylabel="final SERA - uniform, paired (95% CI)")
  paired.grid(alpha=0.3)
  paired.legend(fontsize=8)
  fig.suptitle(f"synthetic1000 (1000 classes, cold start), {num_steps} steps, "
               f"{len(seeds)} seeds (mean ± std), each method at the rate chosen on "
               f"validation", fontsize=10)
  fig.tight_layout()
  save_figure(fig, path, dpi=110)


def _cell(values: np.ndarray) -> str:
  """mean ± std over seeds, or how many diverged."""
  if np.isnan(values).any():
    return f"diverged in {int(np.isnan(values).sum())} of {len(values)} seeds"
  return f"{values.mean():.3f} ± {values.std():.3f}"


def table(results, methods, baselines, seeds) -> str:
  """Per N0 and method: the chosen rate, final held-out pass@1 / pass@256 (mean ± std) and the
  rise of pass@1 over the last quarter of the steps; then SERA - uniform paired."""
  header = ["N0", "method", "lr", *[f"pass@{k}" for k in KS], "pass@1 rise, last quarter"]
  lines = []
  for baseline_n in baselines:
    for method in methods:
      tuned = results[method, baseline_n]
      rise = rise_over_last_quarter(tuned.runs, seeds)
      lines.append([baseline_n, method, f"{tuned.rate:g}",
                    *[_cell(final(results, method, baseline_n, seeds, k)) for k in KS],
                    f"{rise:+.3f}" + (" (still rising)" if rise > RISING else "")])
    for name in ("sera", "sera_rho"):
      if name in methods and "uniform" in methods:
        cells = []
        for k in KS:
          diff = (final(results, name, baseline_n, seeds, k)
                  - final(results, "uniform", baseline_n, seeds, k))
          mean, half = common.mean_interval(diff)
          cells.append(_cell(diff) if np.isnan(diff).any()
                       else f"{mean:+.3f} ± {half:.3f} (95%)")
        lines.append([baseline_n, f"{name} - uniform", "", *cells, ""])
  return common.format_table(header, lines)


def main(argv: list[str] | None = None) -> None:
  parser = common.figure_parser("scaling", __doc__)
  parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
  parser.add_argument("--baselines", nargs="+", type=int, default=list(BASELINES),
                      help="the N0 values (n_max = 4 N0)")
  parser.add_argument("--seeds", nargs="+", type=int, default=list(range(10)),
                      help="the reported seeds (the tuning seed 100 chooses the rates)")
  parser.add_argument("--learning-rates", nargs="+", type=float, default=list(LEARNING_RATES),
                      help="the grid each (method, N0) chooses its rate from")
  parser.add_argument("--num-steps", type=int, default=2000)
  parser.add_argument("--eval-every", type=int, default=100)
  parser.add_argument("--workdir-root", default="runs/budget_scaling")
  common.add_one_by_one(parser)
  argv = sys.argv[1:] if argv is None else argv
  args = parser.parse_args(argv)
  if args.num_steps < 1 or not 1 <= args.eval_every <= args.num_steps:
    parser.error("--num-steps must be >= 1 and --eval-every in [1, num-steps]")
  if any(n0 < 2 for n0 in args.baselines):
    parser.error("every N0 must be >= n_min = 2")
  if not all(rate > 0 for rate in args.learning_rates):
    parser.error("every learning rate must be > 0")
  common.check_reported_seeds(parser, args.seeds, TUNING_SEEDS)
  figure_run = common.start_figure()
  results = train_all(args.methods, args.baselines, args.seeds, sorted(set(args.learning_rates)),
                      args.num_steps, args.eval_every, args.workdir_root, args.one_by_one)
  png, csv = common.output_paths(args.out, NAME)
  rates_png, rates_csv = common.output_paths(args.out, RATES_NAME)
  write_csv(results, args.seeds, csv)
  write_rates_csv(results, rates_csv)
  plot(results, args.methods, args.baselines, args.seeds, args.num_steps, png)
  plot_rates(results, args.methods, args.baselines, rates_png)
  print(table(results, args.methods, args.baselines, args.seeds))
  manifest = common.write_manifest(
      args.out, NAME, figure_run, command="figure scaling", argv=argv, seeds=args.seeds,
      tuning_seeds=TUNING_SEEDS,
      protocol={"num_steps": args.num_steps, "eval_every": args.eval_every,
                "baselines": args.baselines, "learning_rates": common.rate_choices(results)})
  print(f"total {figure_run.elapsed():.0f} s; wrote {png}, {csv}, {rates_png}, "
        f"{rates_csv} and {manifest}")
