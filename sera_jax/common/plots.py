"""Headless matplotlib for every figure of the project, and the moving average of curves."""

import io

import matplotlib

matplotlib.use("Agg")  # figures are files: no display on a cluster node or in CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from etils import epath  # noqa: E402

from sera_jax.common import files  # noqa: E402

__all__ = ["plt", "save_figure", "smooth"]


def save_figure(fig, location: epath.PathLike, **savefig_kwargs) -> None:
  """Writes `fig` to `location` (local or a URL; format from its suffix) and closes it."""
  buffer = io.BytesIO()
  fig.savefig(buffer, format=files.path(location).suffix.lstrip("."), **savefig_kwargs)
  plt.close(fig)
  files.write_bytes(location, buffer.getvalue())


def smooth(values: np.ndarray, window: int) -> np.ndarray:
  """Trailing moving average (the first points average what exists)."""
  cumulative = np.cumsum(np.insert(values, 0, 0.0))
  ends = np.arange(1, len(values) + 1)
  starts = np.maximum(ends - window, 0)
  return (cumulative[ends] - cumulative[starts]) / (ends - starts)
