"""The unbiased pass@k estimator against the binomial formula."""

import math

import numpy as np
import pytest

from sera_jax.common import evaluation

PASS_AT_K = tuple(2**i for i in range(9))


def test_pass_at_k_matches_binomial_formula():
  successes = np.array([0, 1, 7, 100, 255, 256])
  got = evaluation.pass_at_k(successes, 256, PASS_AT_K)
  want = [np.mean([1 - math.comb(256 - c, k) / math.comb(256, k) for c in successes])
          for k in PASS_AT_K]
  np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
  with pytest.raises(ValueError, match=r"\[1, n = 4\]"):
    evaluation.pass_at_k(successes, 4, ks=(8,))
