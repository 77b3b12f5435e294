"""The figure of maze runs: training success rate and held-out pass@k."""

import numpy as np

from sera_jax.common.plots import plt, save_figure, smooth


def plot_runs(runs: list[tuple[str, list[dict]]], path: str, *, window: int = 20) -> None:
  """Training success rate over steps (left) and each run's last pass@k (right).

  Args:
    runs: (label, metric rows) per run; rows as a run writes them to metrics/.
    path: output PNG path.
    window: moving-average window of the success-rate curves.
  """
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  for label, rows in runs:
    rl_rows = [row for row in rows if "reward/maze_mean" in row]
    if rl_rows:
      steps = [row["step"] for row in rl_rows]
      left.plot(steps, smooth(np.array([row["reward/maze_mean"] for row in rl_rows]), window),
                label=label)
    evaluated = [row for row in rows if "pass@1" in row]
    if evaluated:
      last = evaluated[-1]
      ks = sorted(int(name.removeprefix("pass@")) for name in last if name.startswith("pass@"))
      right.plot(ks, [last[f"pass@{k}"] for k in ks], "o-", label=label)
  left.set(xlabel="step", ylabel="success rate per maze of the batch (smoothed)")
  right.set(xscale="log", xlabel="k", ylabel="pass@k (held-out mazes)")
  right.set_xscale("log", base=2)
  for axis in (left, right):
    axis.grid(alpha=0.3)
    if axis.get_legend_handles_labels()[0]:  # none before the first evaluation
      axis.legend()
  fig.tight_layout()
  save_figure(fig, path, dpi=120)
