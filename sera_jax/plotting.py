"""Figures drawn from metric rows (matplotlib, headless)."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

COSINES = (
    ("cos/sera_expected", "SERA expected", "tab:blue", "-"),
    ("cos/sera_realized", "SERA realized", "tab:blue", ":"),
    ("cos/uniform_expected", "uniform expected", "tab:orange", "-"),
    ("cos/uniform_realized", "uniform realized", "tab:orange", ":"),
)
ROLLOUT_STATS = (("rollouts/max", "max n_q"), ("rollouts/std", "std n_q"),
                 ("active_fraction", "active fraction"))


def smooth(values: np.ndarray, window: int) -> np.ndarray:
  """Trailing moving average (the first points average what exists)."""
  cumulative = np.cumsum(np.insert(values, 0, 0.0))
  ends = np.arange(1, len(values) + 1)
  starts = np.maximum(ends - window, 0)
  return (cumulative[ends] - cumulative[starts]) / (ends - starts)


def _series(rows, name):
  points = [(row["step"], row[name]) for row in rows if name in row]
  return np.asarray(points, dtype=float).reshape(-1, 2).T


def plot_alignment(runs: list[tuple[str, list[dict]]], path: str, *, window: int = 20) -> None:
  """Cosine with the exact gradient over steps (top) and rollout statistics (bottom).

  Args:
    runs: (label, metric rows) per run; rows as in metrics.jsonl.
    path: output PNG path.
    window: moving-average window of the smoothed lines (raw points shown faintly).
  """
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True,
                                    gridspec_kw={"height_ratios": [2, 1]})
  fraction_axis = bottom.twinx()
  markers = ("o", "s", "^", "D", "v", "x")
  for run_index, (label, rows) in enumerate(runs):
    prefix = f"{label}: " if len(runs) > 1 else ""
    alpha = 1.0 if run_index == 0 else 0.6
    for name, title, color, style in COSINES:
      steps, values = _series(rows, name)
      if len(steps):
        top.plot(steps, values, markers[run_index % len(markers)], color=color, alpha=0.15,
                 markersize=2)
        top.plot(steps, smooth(values, window), style, color=color, label=prefix + title,
                 alpha=alpha)
    for (name, title), color in zip(ROLLOUT_STATS, ("tab:green", "tab:purple", "tab:gray"),
                                    strict=True):
      steps, values = _series(rows, name)
      axis = fraction_axis if name == "active_fraction" else bottom
      if len(steps):
        axis.plot(steps, values, color=color, label=prefix + title, alpha=alpha)
  top.set_ylabel("cosine with exact gradient")
  top.set_title("Gradient alignment with the exact likelihood gradient")
  top.grid(alpha=0.3)
  top.legend(fontsize=8, ncol=2)
  bottom.set_xlabel("step")
  bottom.set_ylabel("rollouts per prompt")
  fraction_axis.set_ylabel("active fraction")
  fraction_axis.set_ylim(0, 1.05)
  bottom.grid(alpha=0.3)
  handles = [h for axis in (bottom, fraction_axis) for h in axis.get_legend_handles_labels()[0]]
  bottom.legend(handles=handles, fontsize=8, ncol=3, loc="upper right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
