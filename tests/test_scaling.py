"""sera_jax.scaling against 50-digit mpmath values, from log p = -1000 to -1e-12."""

import chex
import jax.numpy as jnp
import mpmath
import numpy as np
import pytest
from absl.testing import parameterized

from sera_jax.method import scaling

mpmath.mp.dps = 50
LOG_PS = [-1000.0, -700.0, -50.0, -10.0, -1.0, -0.5, -0.1, -1e-3, -1e-9, -1e-12]
COUNTS = [0, 1, 2, 3, 8, 64, 512]


def _exact(kind, log_p, n):
  # expm1/log1p keep every digit of p even when p is far below 10^-dps.
  p = mpmath.exp(mpmath.mpf(log_p))
  log_q = mpmath.log1p(-p)
  one_minus_q_to = lambda k: -mpmath.expm1(k * log_q)  # noqa: E731
  if kind == "fidelity":
    return 0 if n == 0 else one_minus_q_to(n - 1)
  if kind == "coverage":
    return one_minus_q_to(n)
  if kind == "mixed":
    return 0 if n == 0 else one_minus_q_to(n) - p**n
  raise ValueError(kind)


def _assert_close(actual, expected, rtol):
  """Relative error where the value is a normal float, absolute below."""
  expected = float(expected)
  tiny = np.finfo(np.float64).tiny
  scale = max(abs(expected), tiny)
  assert abs(float(actual) - expected) <= rtol * scale + tiny, (float(actual), expected)


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("kind,fn", [
    ("fidelity", scaling.fidelity),
    ("coverage", scaling.coverage),
    ("mixed", scaling.mixed_probability),
])
def test_accurate_over_the_whole_range_in_float64(kind, fn):
  for log_p in LOG_PS:
    values = fn(jnp.full(len(COUNTS), log_p), jnp.asarray(COUNTS))
    for n, value in zip(COUNTS, np.asarray(values), strict=True):
      _assert_close(value, _exact(kind, log_p, n), rtol=1e-12)


@pytest.mark.parametrize("fn", [scaling.fidelity, scaling.coverage, scaling.mixed_probability])
def test_finite_and_in_unit_interval_in_float32(fn):
  values = fn(jnp.asarray(LOG_PS, jnp.float32)[:, None], jnp.asarray(COUNTS)[None, :])
  assert values.dtype == jnp.float32
  assert np.all(np.isfinite(values)) and np.all((values >= 0) & (values <= 1))


def test_float32_relative_accuracy_where_representable():
  log_ps = jnp.asarray([-50.0, -10.0, -1.0, -1e-3, -1e-9], jnp.float32)
  values = scaling.fidelity(log_ps[:, None], jnp.asarray([2, 8, 512])[None, :])
  for i, log_p in enumerate(np.asarray(log_ps, np.float64)):
    for j, n in enumerate([2, 8, 512]):
      _assert_close(values[i, j], _exact("fidelity", float(log_p), n), rtol=1e-5)


def test_special_values():
  chex.assert_trees_all_close(scaling.fidelity(0.0, jnp.array([0, 1, 2])), jnp.array([0.0, 0, 1]))
  chex.assert_trees_all_close(scaling.coverage(0.0, jnp.array([0, 1])), jnp.array([0.0, 1]))
  chex.assert_trees_all_close(scaling.mixed_probability(-0.5, 0), jnp.array(0.0))
  assert float(scaling.mixed_probability(0.0, 4)) == 0.0


@pytest.mark.usefixtures("x64")
def test_failure_rate_and_log1mexp():
  for log_p in LOG_PS:
    expected = -mpmath.log1p(-mpmath.exp(mpmath.mpf(log_p)))
    _assert_close(scaling.failure_rate(jnp.asarray(log_p)), expected, rtol=1e-13)


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("p", [1e-3, 0.3, 0.9])
def test_truncated_objective_converges_to_log_p_and_has_coverage_gradient(p):
  import jax

  log_p = jnp.log(p)
  exact = -sum(mpmath.mpf(1 - p) ** k / k for k in range(1, 9))
  _assert_close(scaling.truncated_objective(log_p, 8), exact, rtol=1e-12)
  # dJ_n / dlog p = p dJ_n/dp = coverage(p, n).
  grad = jax.grad(lambda lp: scaling.truncated_objective(lp, 8))(log_p)
  _assert_close(grad, scaling.coverage(log_p, 8), rtol=1e-10)
  if p > 0.1:
    _assert_close(scaling.truncated_objective(log_p, 4000), float(log_p), rtol=1e-12)
  assert float(scaling.truncated_objective(log_p, 0)) == 0.0


class JitTest(parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_same_values_jitted_and_not(self):
    log_p = jnp.asarray([-20.0, -1.0, -1e-6])
    n = jnp.asarray([1, 4, 9])
    for fn in (scaling.fidelity, scaling.coverage, scaling.mixed_probability):
      chex.assert_trees_all_close(self.variant(fn)(log_p, n), fn(log_p, n), rtol=1e-6)


@pytest.mark.parametrize("bad,what", [
    (float("nan"), "NaN"), (0.5, "positive"), (-float("inf"), "-inf"),
])
def test_rejects_invalid_log_probabilities(bad, what):
  for fn in (scaling.fidelity, scaling.coverage, scaling.mixed_probability):
    with pytest.raises(ValueError, match=f"log_p.*{what}"):
      fn(jnp.asarray([-1.0, bad]), 3)
  with pytest.raises(ValueError, match="log_p"):
    scaling.truncated_objective(jnp.asarray([bad]), 3)
