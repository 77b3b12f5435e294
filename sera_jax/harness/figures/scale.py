"""Scale equalization: kappa(p_q, n_q) against p_q, uniform versus SERA.

For one fixed batch of M training prompts and the early, midway and late
snapshots of the run of sera_jax.harness.figures.common (default digits, method ce), it draws
kappa(p_q, n_q) = 1 - (1 - p_q)^(n_q - 1) (docs/method.md#the-estimator-and-its-scale) against
the exact p_q on log axes under the uniform allocation (n_q = N0) and under SERA (same budget
M N0), with SERA's waterline (the target fidelity 1 - exp(-tau), docs/method.md#the-waterline),
and n_q against p_q underneath. Prompts SERA switches off (n_q = 0, kappa = 0)
are drawn as crosses on the bottom edge.

  sera-jax figure scale           # or: python experiments/scale_equalization.py

Writes OUT/scale_equalization.png and OUT/scale_equalization.csv (default
OUT = docs/figures) and prints the table.
"""

import sys

import jax
import numpy as np
from matplotlib.ticker import NullFormatter

from sera_jax.common import files
from sera_jax.common.plots import plt, save_figure
from sera_jax.harness.figures import common
from sera_jax.method import scaling, success
from sera_jax.settings.classification import alignment

NAME = "scale_equalization"
CPU_COST = "about 10 s after budget"  # on a 2-core CPU (`sera-jax figure --list`)
MODES = (("uniform", "tab:orange", "o"), ("sera", "tab:blue", "s"))


def allocations(task, workdir, snapshots):
  """Rows of (snapshot, prompt) with p and both allocations, and the waterlines."""
  config = task.config
  batch = common.evaluation_batches(task.dataset, config.batch_size, 1)[0]
  methods = {mode: alignment.oracle_method(baseline_n=config.baseline_n, n_min=config.n_min,
                                         n_max=config.n_max, mode=mode,
                                         threshold=config.threshold)
             for mode, _, _ in MODES}
  rows, waterlines = [], {}
  for snapshot, step in snapshots.items():
    state = common.load_state(task, workdir, step)
    logits = common.forward_logits(task, state, batch.images)
    labels = jax.numpy.asarray(batch.labels)
    log_p = np.asarray(success.oracle_log_p(logits, labels))
    allocs = {mode: jax.device_get(method.allocate(None, logits, labels, {}))
              for mode, method in methods.items()}
    waterlines[snapshot] = float(allocs["sera"].target_fidelity)
    for q in range(len(log_p)):
      row = {"snapshot": snapshot, "step": step, "prompt": int(batch.ids[q]),
             "label": int(batch.labels[q]), "p": float(np.exp(log_p[q])), "log_p": float(log_p[q])}
      for mode in methods:
        row |= {f"{mode}_n": int(allocs[mode].counts[q]),
                f"{mode}_kappa": float(allocs[mode].fidelity[q]),
                f"{mode}_active": bool(allocs[mode].active[q])}
      row["sera_waterline"] = waterlines[snapshot]
      rows.append(row)
  return rows, waterlines


def plot(rows, snapshots, waterlines, config, path):
  fig, axes = plt.subplots(2, len(snapshots), figsize=(4.3 * len(snapshots), 7), squeeze=False,
                           sharex="col", gridspec_kw={"height_ratios": [3, 2]})
  positive = [r[f"{m}_kappa"] for r in rows for m, _, _ in MODES if r[f"{m}_kappa"] > 0]
  floor = min(positive) / 3
  for column, (snapshot, step) in enumerate(snapshots.items()):
    top, bottom = axes[0, column], axes[1, column]
    points = [r for r in rows if r["snapshot"] == snapshot]
    p = np.array([r["p"] for r in points])
    for mode, color, marker in MODES:
      kappa = np.array([r[f"{mode}_kappa"] for r in points])
      counts = np.array([r[f"{mode}_n"] for r in points])
      on = counts > 0
      top.scatter(p[on], kappa[on], color=color, marker=marker, s=16, alpha=0.7,
                  label=f"{mode} (n = {config.baseline_n})" if mode == "uniform" else mode)
      bottom.scatter(p[on], counts[on], color=color, marker=marker, s=16, alpha=0.7)
      if (~on).any():
        top.scatter(p[~on], np.full((~on).sum(), floor), color=color, marker="x", s=20,
                    label=f"{mode} inactive (n = 0)")
        bottom.scatter(p[~on], np.zeros((~on).sum()), color=color, marker="x", s=20)
    grid = np.logspace(np.log10(p.min()), np.log10(p.max()), 200)
    top.plot(grid, scaling.fidelity(np.log(grid), config.baseline_n), color="tab:orange",
             lw=0.8, alpha=0.6)
    top.axhline(waterlines[snapshot], color="tab:blue", ls="--", lw=1,
                label=f"SERA waterline {waterlines[snapshot]:.3f}")
    top.set(xscale="log", yscale="log", ylim=(floor / 1.5, 1.5),
            title=f"{snapshot} snapshot (step {step})")
    bottom.set(xscale="log", yscale="symlog", xlabel="p_q (exact)")
    for axis in (top, bottom):
      axis.xaxis.set_minor_formatter(NullFormatter())
      axis.grid(alpha=0.3)
    top.legend(fontsize=7, loc="lower right")
  axes[0, 0].set_ylabel("kappa(p_q, n_q)")
  axes[1, 0].set_ylabel("n_q (same budget M N0)")
  fig.suptitle(f"Scale equalization on one batch of {len(points)} prompts: N0 = "
               f"{config.baseline_n}, n_min = {config.n_min}, n_max = {config.n_max}", fontsize=10)
  fig.tight_layout()
  save_figure(fig, path, dpi=120)


def table(rows, snapshots, waterlines) -> str:
  header = ["snapshot", "p q10", "p q50", "p q90", "uniform kappa min", "uniform kappa max",
            "sera kappa min (active)", "sera kappa max", "waterline", "sera active", "sera n max"]
  lines = []
  for snapshot in snapshots:
    points = [r for r in rows if r["snapshot"] == snapshot]
    p = np.array([r["p"] for r in points])
    uniform = np.array([r["uniform_kappa"] for r in points])
    active = np.array([r["sera_active"] for r in points])
    sera = np.array([r["sera_kappa"] for r in points])[active]
    lines.append([snapshot, *[float(v) for v in np.quantile(p, [0.1, 0.5, 0.9])],
                  float(uniform.min()), float(uniform.max()), float(sera.min()),
                  float(sera.max()), waterlines[snapshot], f"{active.sum()}/{len(points)}",
                  max(r["sera_n"] for r in points)])
  return common.format_table(header, lines)


def main(argv=None):
  parser = common.figure_parser("scale", __doc__)
  common.add_run_arguments(parser, seeds=None)
  argv = sys.argv[1:] if argv is None else argv
  args = parser.parse_args(argv)
  figure_run = common.start_figure()
  task, workdir, snapshots = common.prepare_run(args)
  rows, waterlines = allocations(task, workdir, snapshots)
  png, csv = common.output_paths(args.out, NAME)
  files.write_csv(csv, rows)
  plot(rows, snapshots, waterlines, task.config, png)
  print(table(rows, snapshots, waterlines))
  manifest = common.write_manifest(
      args.out, NAME, figure_run, command="figure scale", argv=argv, seeds=[], tuning_seeds=[],
      protocol=common.snapshot_protocol(args, task, snapshots))
  print(f"\nwrote {png}, {csv} and {manifest} in {figure_run.elapsed():.0f} s")
  return rows

