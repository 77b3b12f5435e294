"""Headless matplotlib for every figure of the project, and the moving average of curves."""

import matplotlib

matplotlib.use("Agg")  # figures are files: no display on a cluster node or in CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

__all__ = ["plt", "smooth"]


def smooth(values: np.ndarray, window: int) -> np.ndarray:
  """Trailing moving average (the first points average what exists)."""
  cumulative = np.cumsum(np.insert(values, 0, 0.0))
  ends = np.arange(1, len(values) + 1)
  starts = np.maximum(ends - window, 0)
  return (cumulative[ends] - cumulative[starts]) / (ends - starts)
