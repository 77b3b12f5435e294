"""Ablations of SERA, each against full SERA at the same budget.

On the early, midway and late snapshots of the run of sera_jax.harness.figures.common
(default digits, method ce) and --batches fixed batches of M training prompts,
every variant's expected cosine with the exact gradient and its realized
cosine over --seeds sampling seeds are measured in one jitted call per
(snapshot, batch) (all variants and seeds: one vmap, one VJP). Reported: the
change from full SERA (oracle p, maxrl, threshold 0.05, n_max = 4 N0, w = N0 / n)
of the mean expected cosine and of the mean realized cosine, the latter with a
95% interval over the paired (snapshot, batch, seed) differences.

Variants: no multiplicity correction (w = 1); no active set ("equalized");
threshold 0 / 0.01 / 0.2; n_max = N0 (every n_q = N0: uniform counts) / 2 N0 /
8 N0; rho normalization; p from the historical estimate (docs/method.md#estimating-p, replayed
from the run's per-epoch checkpoints) or from a pilot of 2 or 4 rollouts per
prompt (the pilot's rollouts only estimate p and count against the budget);
the maxrl_plain estimator.

  sera-jax figure ablations       # or: python experiments/ablations.py

Writes OUT/ablations.png and OUT/ablations.csv (default OUT = docs/figures) and
prints the table.
"""

import sys

import jax
import numpy as np

from sera_jax.common import files
from sera_jax.common.plots import plt, save_figure
from sera_jax.harness.figures import common
from sera_jax.settings.classification import alignment

NAME = "ablations"
CPU_COST = "about 20 s after budget"  # on a 2-core CPU (`sera-jax figure --list`)
REFERENCE = "SERA (reference)"


def variants(config) -> dict[str, tuple[str, alignment.Method]]:
  """name -> (group, method); the first is the reference (full SERA, oracle p)."""
  n0 = config.baseline_n
  base = dict(baseline_n=n0, n_min=config.n_min, n_max=config.n_max, mode="sera",
              threshold=config.threshold)
  oracle = lambda **change: alignment.oracle_method(**base | change)  # noqa: E731
  table = {
      REFERENCE: ("reference", oracle()),
      "w = 1 (no multiplicity correction)": (
          "weights", oracle(normalize_by_rollout_count=False)),
      "rho normalization": ("weights", oracle(normalize_by_rho=True)),
      "no active set (equalized)": ("active set", oracle(mode="equalized")),
  }
  for threshold in (0.0, 0.01, 0.05, 0.2):
    if threshold != config.threshold:
      table[f"threshold {threshold:g}"] = ("active set", oracle(threshold=threshold))
  for factor in (1, 2, 4, 8):
    if factor * n0 != config.n_max:
      label = " (uniform counts)" if factor == 1 else ""
      table[f"n_max = {factor} N0{label}"] = ("n_max", oracle(n_max=factor * n0))
  table["p: historical (discounted Beta)"] = ("p source", alignment.estimate_method(
      "historical_log_p", **base))
  for num_pilot in (2, 4):
    if num_pilot < n0:
      table[f"p: pilot {num_pilot} rollouts"] = ("p source", alignment.pilot_method(
          num_pilot, **base))
  table["estimator maxrl_plain"] = ("estimator", oracle(estimator="maxrl_plain"))
  return table


def measure(task, workdir, snapshots, num_batches, num_seeds):
  """{variant: {snapshot: Alignment stacked over batches [B, S]}}."""
  config = task.config
  table = variants(config)
  evaluate = alignment.make_evaluator(task, {name: method for name, (_, method) in table.items()})
  batches = common.evaluation_batches(task.dataset, config.batch_size, num_batches)
  historical = common.historical_log_p(task, workdir, sorted(set(snapshots.values())),
                                        seed=config.seed)
  keys = alignment.seed_keys(config.seed, num_seeds)
  results = {name: {} for name in table}
  for snapshot, step in snapshots.items():
    state = common.load_state(task, workdir, step)
    per_batch = [jax.device_get(evaluate(state, batch.images, batch.labels, keys,
                                         {"historical_log_p": historical[step][batch.ids]}))
                 for batch in batches]
    for name in table:
      results[name][snapshot] = jax.tree.map(lambda *x: np.stack(x),
                                             *[r[name] for r in per_batch])
  return table, results


def summarize(table, results, snapshots):
  """CSV rows: per variant, over all snapshots ("all") and per snapshot."""
  rows = []
  for scope in ["all", *snapshots]:
    chosen = list(snapshots) if scope == "all" else [scope]

    def stack(name, field, chosen=chosen):  # [snapshots, batches, seeds]
      return np.stack([getattr(results[name][s], field) for s in chosen])

    reference_realized = stack(REFERENCE, "realized")
    reference_expected = stack(REFERENCE, "expected").mean()
    for name, (group, _) in table.items():
      realized, expected = stack(name, "realized"), stack(name, "expected")
      delta_mean, delta_half = common.mean_interval((realized - reference_realized).ravel())
      rows.append({
          "scope": scope, "variant": name, "group": group,
          "expected_cos": float(expected.mean()), "realized_cos": float(realized.mean()),
          "delta_expected": float(expected.mean() - reference_expected),
          "delta_realized": float(delta_mean), "delta_realized_ci95": float(delta_half),
          "expected_norm_ratio": float(stack(name, "norm_ratio").mean()),
          "active_fraction": float(stack(name, "active_fraction").mean()),
          "num_units": int(realized.size),
      })
  return rows


def plot(rows, path, title):
  rows = [r for r in rows if r["scope"] == "all" and r["variant"] != REFERENCE]
  names = [r["variant"] for r in rows][::-1]
  positions = np.arange(len(names))
  fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(names) + 1.6), sharey=True)
  for axis, field, label in ((axes[0], "delta_expected", "change in expected cosine"),
                             (axes[1], "delta_realized", "change in mean realized cosine")):
    values = np.array([r[field] for r in rows][::-1])
    errors = (np.array([r["delta_realized_ci95"] for r in rows][::-1])
              if field == "delta_realized" else None)
    colors = ["tab:green" if v >= 0 else "tab:red" for v in values]
    axis.barh(positions, values, xerr=errors, color=colors, alpha=0.8, capsize=3)
    axis.axvline(0, color="black", lw=0.8)
    axis.set_xscale("symlog", linthresh=1e-3)
    axis.set_xlabel(label + " vs full SERA (symlog)")
    axis.grid(axis="x", alpha=0.3)
  axes[0].set_yticks(positions, names)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  save_figure(fig, path, dpi=120)


def main(argv=None):
  parser = common.figure_parser("ablations", __doc__)
  common.add_run_arguments(parser, seeds=16)
  parser.add_argument("--batches", type=int, default=2, help="fixed batches per snapshot")
  argv = sys.argv[1:] if argv is None else argv
  args = parser.parse_args(argv)
  if args.seeds < 2:
    parser.error("--seeds must be >= 2 for an interval")
  figure_run = common.start_figure()
  task, workdir, snapshots = common.prepare_run(args)
  table, results = measure(task, workdir, snapshots, args.batches, args.seeds)
  rows = summarize(table, results, snapshots)
  config = task.config
  png, csv = common.output_paths(args.out, NAME)
  files.write_csv(csv, rows)
  reference = next(r for r in rows if r["scope"] == "all" and r["variant"] == REFERENCE)
  title = (f"Ablations vs full SERA (expected cos {reference['expected_cos']:.4f}, realized "
           f"{reference['realized_cos']:.4f}); M = {config.batch_size}, N0 = {config.baseline_n}, "
           f"{len(snapshots)} snapshots x {args.batches} batches x {args.seeds} seeds")
  plot(rows, png, title)
  header = ["variant", "expected", "realized", "d expected", "d realized", "+-95%",
            "|E g|/|g*|", "active"]
  print(common.format_table(header, [
      [r["variant"], r["expected_cos"], r["realized_cos"], r["delta_expected"],
       r["delta_realized"], r["delta_realized_ci95"], r["expected_norm_ratio"],
       r["active_fraction"]] for r in rows if r["scope"] == "all"]))
  manifest = common.write_manifest(
      args.out, NAME, figure_run, command="figure ablations", argv=argv,
      seeds=list(range(args.seeds)), tuning_seeds=[],
      protocol=common.snapshot_protocol(args, task, snapshots, batches=args.batches))
  print(f"\nwrote {png}, {csv} and {manifest} in {figure_run.elapsed():.0f} s")
  return rows

