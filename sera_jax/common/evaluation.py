"""Scores of sampled answers shared by the settings."""

import numpy as np


def pass_at_k(successes: np.ndarray, num_samples: int, ks) -> np.ndarray:
  """Unbiased pass@k = 1 - C(n - c, k) / C(n, k), averaged over problems.

  C(n - c, k) / C(n, k) = prod_{i<k} (1 - c / (n - i)) is summed in log space
  (float64), so large n and k neither overflow nor cancel.

  Args:
    successes: int [Q], the successes c among n samples of each problem.
    num_samples: n.
    ks: the k to report, each in [1, n].

  Returns:
    float64 [len(ks)].
  """
  ks = np.asarray(ks)
  if ks.min() < 1 or ks.max() > num_samples:
    raise ValueError(f"every k must lie in [1, n = {num_samples}]; got {ks.tolist()}.")
  successes = np.asarray(successes, np.float64)[:, None]
  remaining = num_samples - np.arange(num_samples, dtype=np.float64)[None, :]  # n - i
  # Once n - i <= c the product is 0 (log1p(-1) = -inf); later factors are irrelevant.
  with np.errstate(divide="ignore"):
    log_terms = np.log1p(-np.minimum(successes / remaining, 1.0))
  log_all_fail = np.cumsum(log_terms, axis=1)  # column k - 1: log C(n - c, k) / C(n, k)
  return np.mean(-np.expm1(log_all_fail[:, ks - 1]), axis=0)
