"""The alignment figure of classification runs: cosines with the exact gradient over steps."""


import numpy as np

from sera_jax.common import files
from sera_jax.common.plots import plt, save_figure, smooth

# Per estimator measured on every alignment step: (metric, title, line style); each
# estimator gets its own panel.
COSINE_PANELS = (
    ("SERA", (("cos/sera_expected", "expected", "-"), ("cos/sera_realized", "realized", ":"))),
    ("uniform MaxRL", (("cos/uniform_expected", "expected", "-"),
                       ("cos/uniform_realized", "realized", ":"))),
)
COSINES = tuple(series for _, panel in COSINE_PANELS for series in panel)
ROLLOUT_STATS = (("rollouts/max", "max n_q", "-"), ("rollouts/std", "std n_q", "--"),
                 ("active_fraction", "active fraction", ":"))
RUN_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
              "tab:pink", "tab:olive", "tab:cyan", "tab:gray")
CSV_FIELDS = ("run", "series", "step", "value", "smoothed")


def _series(rows, name):
  points = [(row["step"], row[name]) for row in rows if name in row]
  return np.asarray(points, dtype=float).reshape(-1, 2).T


def _run_series(label: str, rows: list[dict], window: int) -> dict[str, list[dict]]:
  """One run's plotted points by metric name (only metrics the rows hold)."""
  by_name = {}
  for name, *_ in COSINES + ROLLOUT_STATS:
    steps, values = _series(rows, name)
    if len(steps):
      smoothed = smooth(values, window) if name.startswith("cos/") else values
      by_name[name] = [{"run": label, "series": name, "step": int(step), "value": float(value),
                        "smoothed": float(average)}
                       for step, value, average in zip(steps, values, smoothed, strict=True)]
  return by_name


def alignment_series(runs: list[tuple[str, list[dict]]], *, window: int = 20) -> list[dict]:
  """The series `plot_alignment` draws, one dict per point (fields `CSV_FIELDS`).

  Cosines carry their moving average in `smoothed`; rollout statistics are drawn
  raw, so theirs equals `value`.
  """
  return [point for label, rows in runs
          for points in _run_series(label, rows, window).values() for point in points]


def plot_alignment(runs: list[tuple[str, list[dict]]], path: str, *, window: int = 20,
                   csv_path: str | None = None) -> None:
  """Cosines with the exact gradient over steps (top) and rollout statistics (bottom).

  One top panel per estimator (SERA, uniform MaxRL), both measured on the
  batches of every run; a colour per run, expected solid, realized dotted,
  smoothed lines over the faint raw points.

  Args:
    runs: (label, metric rows) per run; rows as a run writes them to metrics/.
    path: output PNG path.
    window: moving-average window of the smoothed lines.
    csv_path: also write the plotted series there (see `alignment_series`).
  """
  fig = plt.figure(figsize=(11, 7.5))
  grid = fig.add_gridspec(2, 2, height_ratios=[2, 1])
  first = fig.add_subplot(grid[0, 0])
  panels = [first, fig.add_subplot(grid[0, 1], sharex=first, sharey=first)]
  bottom = fig.add_subplot(grid[1, :], sharex=first)
  fraction_axis = bottom.twinx()
  markers = ("o", "s", "^", "D", "v", "x")
  several = len(runs) > 1
  for run_index, (label, rows) in enumerate(runs):
    prefix = f"{label}: " if several else ""
    color = RUN_COLORS[run_index % len(RUN_COLORS)]
    by_name = _run_series(label, rows, window)
    for axis, (_, panel) in zip(panels, COSINE_PANELS, strict=True):
      for name, title, style in panel:
        if name in by_name:
          steps = [p["step"] for p in by_name[name]]
          axis.plot(steps, [p["value"] for p in by_name[name]], markers[run_index % len(markers)],
                    color=color, alpha=0.12, markersize=2)
          axis.plot(steps, [p["smoothed"] for p in by_name[name]], style, color=color,
                    label=prefix + title)
    for name, title, style in ROLLOUT_STATS:
      if name in by_name:
        axis = fraction_axis if name == "active_fraction" else bottom
        axis.plot([p["step"] for p in by_name[name]], [p["value"] for p in by_name[name]], style,
                  color=color, label=prefix + title)
  for axis, (estimator, _) in zip(panels, COSINE_PANELS, strict=True):
    axis.set_title(f"{estimator} gradient vs the exact gradient")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8, loc="lower left")
  panels[0].set_ylabel("cosine")
  bottom.set_xlabel("step")
  bottom.set_ylabel("rollouts per prompt")
  fraction_axis.set_ylabel("active fraction")
  fraction_axis.set_ylim(0, 1.05)
  bottom.grid(alpha=0.3)
  handles = [h for axis in (bottom, fraction_axis) for h in axis.get_legend_handles_labels()[0]]
  bottom.legend(handles=handles, fontsize=8, ncol=3, loc="upper center",
                bbox_to_anchor=(0.5, -0.25))
  fig.suptitle(f"Gradient alignment, smoothed over {window} steps")
  fig.tight_layout()
  save_figure(fig, path, dpi=120, bbox_inches="tight")  # keeps the legend below the axes
  if csv_path:
    files.write_csv(csv_path, alignment_series(runs, window=window), CSV_FIELDS)
