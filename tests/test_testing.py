"""Tests of sera_jax.testing: objective scales, exact unbiasedness, Monte Carlo bias, verdicts."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import sera_jax
from sera_jax import testing
from sera_jax.method import estimators

EPS = 1e-6
DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "testing_estimators.md"


# --- objective_scale --------------------------------------------------------------------------

# Each objective as a function of p, differentiated here by autodiff: s_J = dJ / dlog p.
OBJECTIVES = {
    "log_p": jnp.log,
    "p": lambda p: p,
    "pass@1": lambda p: p,
    "pass@3": lambda p: 1 - (1 - p) ** 3,
    "pass@8": lambda p: 1 - (1 - p) ** 8,
    "truncated@1": lambda p: p,
    "truncated@5": lambda p: sum((1 - (1 - p) ** k) / k for k in range(1, 6)),
}


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_objective_scale_is_the_objectives_derivative_in_log_p(objective):
  with jax.enable_x64(True):
    log_p = jnp.log(jnp.asarray([1e-4, 0.01, 0.3, 0.5, 0.9, 1 - 1e-4]))
    want = jax.vmap(jax.grad(lambda x: OBJECTIVES[objective](jnp.exp(x))))(log_p)
    got = testing.objective_scale(objective, log_p)
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_truncated_objectives_tend_to_log_p_and_start_at_p():
  with jax.enable_x64(True):
    log_p = jnp.log(jnp.asarray([0.05, 0.5]))
    np.testing.assert_allclose(testing.objective_scale("truncated@2000", log_p), 1.0, rtol=1e-12)
    np.testing.assert_allclose(testing.objective_scale("truncated@1", log_p), jnp.exp(log_p))
    assert testing.objective_scale("pass@4", 0.0) == 0.0  # p = 1: nothing left to gain


@pytest.mark.parametrize(("claim", "n", "params", "want"), [
    ("truncated@n-1", 8, {}, "truncated@7"),
    ("truncated@n", 8, {}, "truncated@8"),
    ("pass@k", 8, {"k": 4}, "pass@4"),
    ("truncated@order", 3, {"order": 12}, "truncated@12"),
    ("pass@2", 1, {}, "pass@2"),
    ("log_p", 5, {}, "log_p"),
])
def test_resolve_objective_makes_the_order_a_number(claim, n, params, want):
  assert estimators.resolve_objective(claim, n, params) == want


@pytest.mark.parametrize(("claim", "n", "params", "match"), [
    ("likelihood", 4, {}, r"objective must be 'p', 'log_p'"),
    ("pass@0", 4, {}, r"objective must be"),
    ("truncated@n-1", 1, {}, r"order 0 at n = 1: a constant objective"),
    ("pass@k", 4, {}, r"names the parameter 'k'"),
])
def test_resolve_objective_rejects(claim, n, params, match):
  with pytest.raises(ValueError, match=match):
    estimators.resolve_objective(claim, n, params)


# --- unbiasedness -----------------------------------------------------------------------------


def _rloo_by_hand(reward, group_size, successes):
  return jnp.where(group_size > 1, reward - (successes - reward) / (group_size - 1), 0.0)


@pytest.mark.parametrize(("estimator", "objective", "n", "params", "scale"), [
    ("maxrl", "truncated@n-1", 8, {}, 1.0),
    ("maxrl_plain", "truncated@n", 5, {}, 1.0),
    ("rloo", "p", 4, {}, 1.0),
    ("reinforce", "p", 4, {}, 0.75),
    ("drgrpo", "p", 10, {}, 0.9),
    ("maclaurin", "truncated@order", 16, {"order": 8}, 1 / 16),
    ("maclaurin_baseline", "truncated@order", 7, {"order": 1}, 1 / 7),  # r / n
    ("maclaurin_baseline", "truncated@order", 2, {"order": 2}, 0.5),
    ("grpo", "p", 2, {}, 1.0),  # at n = 2 GRPO's advantages are +-1: RLOO's
    (_rloo_by_hand, "p", 6, {}, 1.0),
])
def test_unbiased_estimators_report_their_scale(estimator, objective, n, params, scale):
  report = testing.assert_unbiased(estimator, objective, n=n, **params)
  assert report.unbiased and report.max_deviation < 1e-10, report
  np.testing.assert_allclose(report.scale, scale, rtol=1e-10)
  assert report.p.min() == pytest.approx(1e-4) and report.p.max() == pytest.approx(1 - 1e-4)
  assert "is unbiased" in str(report)


def test_a_biased_estimator_raises_naming_the_worst_p():
  report = testing.unbiasedness("maxrl", "log_p", n=8)
  assert not report.unbiased
  # kappa = 1 - (1 - p)^7 is furthest from its median where it is smallest: at the grid's
  # smallest p.
  assert report.worst_p == report.p.min()
  np.testing.assert_allclose(report.ratio, 1 - (1 - report.p) ** 7, rtol=1e-10)
  with pytest.raises(AssertionError, match=r"maxrl is not unbiased for log_p at n = 8: .* "
                                           r"at p = 0\.0001 \(rtol 1e-06\)"):
    testing.assert_unbiased("maxrl", "log_p", n=8)


def test_the_stabiliser_and_the_tolerance_are_the_callers():
  # eps = 1e-3 moves centered MaxRL's scale by about eps / p at small p: biased at rtol 1e-6,
  # unbiased once the tolerance admits it.
  assert not testing.unbiasedness("maxrl", "truncated@n-1", n=8, eps=1e-3).unbiased
  assert testing.unbiasedness("maxrl", "truncated@n-1", n=8, eps=1e-3, p=[0.3, 0.5, 0.7],
                              rtol=1e-2).unbiased


def test_no_signal_is_not_unbiased():
  report = testing.unbiasedness("maxrl", "log_p", n=1)
  assert not report.unbiased and report.scale == 0 and "no signal" in str(report)
  report = testing.unbiasedness(lambda r, n, k: -(r - k / n), "p", n=4)  # points down-hill
  assert not report.unbiased and "no positive multiple" in str(report)


def test_unbiasedness_takes_a_grid_and_rejects_p_outside_it():
  report = testing.unbiasedness("rloo", "p", n=3, p=[0.2, 0.4])
  np.testing.assert_array_equal(report.p, [0.2, 0.4])
  with pytest.raises(ValueError, match="strictly between 0 and 1"):
    testing.unbiasedness("rloo", "p", n=3, p=[0.0, 0.5])
  # One p says nothing: its ratio is a constant whatever the estimator (K/n r is biased).
  for one in (0.3, [0.3, 0.3]):
    with pytest.raises(ValueError, match="at least two distinct values"):
      testing.unbiasedness(lambda r, n, k: r * k / n, "p", n=8, p=one)


# --- monte_carlo_bias ---------------------------------------------------------------------------


def test_z_scores_are_the_projected_means_in_standard_errors():
  rng = np.random.default_rng(0)
  draws = rng.normal(size=(50, 2, 3))
  expected = np.zeros((2, 3))
  directions = rng.normal(size=(4, 6))
  report = testing.monte_carlo_bias(draws, expected, directions=3 * directions)
  projected = draws.reshape(50, 6) @ (directions / np.linalg.norm(directions, axis=1,
                                                                  keepdims=True)).T
  want = projected.mean(0) / (projected.std(0, ddof=1) / np.sqrt(50))
  np.testing.assert_allclose(report.z, want, rtol=1e-12)
  assert report.draws == 50 and report.worst == int(np.argmax(np.abs(want)))


@pytest.mark.parametrize("draws", [2, 3, 20, 50, 400])
@pytest.mark.parametrize("false_alarm", [1e-2, 1e-5])
def test_the_limit_is_students_bonferroni_quantile(draws, false_alarm):
  """Exact at every R: at R = 2 the limit for 1e-3 over 3 directions is 1909.9, where an
  expansion in 1 / (R - 1) gave 303.4 and raised false alarms above the stated rate."""
  report = testing.monte_carlo_bias(np.eye(draws, 3), np.zeros(3), directions=np.eye(3),
                                    false_alarm=false_alarm)
  want = stats.t.ppf(1 - false_alarm / 6, draws - 1)
  np.testing.assert_allclose(report.limit, want, rtol=1e-12)


def test_the_false_alarm_rate_holds_for_an_unbiased_mean():
  # Bonferroni over 4 independent coordinates at 0.05: 1 - (1 - 0.0125)^4 = 0.049 for normal
  # draws; 2000 trials put 3 standard deviations at +-0.015.
  rng = np.random.default_rng(1)
  alarms = [not testing.monte_carlo_bias(rng.normal(size=(100, 4)), np.zeros(4),
                                         directions=np.eye(4), false_alarm=0.05).consistent
            for _ in range(2000)]
  assert 0.034 < np.mean(alarms) < 0.064


def test_a_biased_mean_is_detected_on_its_direction():
  rng = np.random.default_rng(2)
  draws = rng.normal(size=(400, 5))
  draws[:, 3] += 0.5
  report = testing.monte_carlo_bias(draws, np.zeros(5), directions=np.eye(5))
  assert not report.consistent and report.worst == 3 and report.z[3] > 5
  assert "biased against" in str(report)


def test_default_directions_start_with_the_expected_one():
  rng = np.random.default_rng(3)
  expected = np.array([1.0, -2.0, 0.5])
  draws = expected + rng.normal(size=(300, 3))
  report = testing.monte_carlo_bias(draws, expected, num_directions=5, seed=4)
  projected = draws @ expected / np.linalg.norm(expected)
  want = (projected.mean() - np.linalg.norm(expected)) / (projected.std(ddof=1) / np.sqrt(300))
  np.testing.assert_allclose(report.z[0], want, rtol=1e-12)
  assert len(report.z) == 5 and report.consistent


def test_an_exact_constant_draw_has_z_zero_and_a_wrong_one_infinite_z():
  report = testing.monte_carlo_bias(np.ones((5, 2)), np.array([1.0, 2.0]), directions=np.eye(2))
  assert report.z[0] == 0 and report.z[1] == -np.inf and not report.consistent


@pytest.mark.parametrize(("args", "kwargs", "match"), [
    ((np.ones((1, 2)), np.ones(2)), {}, r"R >= 2 draws"),
    ((np.ones((3, 2)), np.ones(3)), {}, r"expected has 3 entries, a draw 2"),
    ((np.ones((3, 2)), np.ones(2)), {"false_alarm": 0.0}, r"false_alarm must lie in \(0, 1\)"),
    ((np.ones((3, 2)), np.ones(2)), {"directions": [[0.0, 0.0]]}, r"directions must be non-zero"),
])
def test_monte_carlo_bias_rejects(args, kwargs, match):
  with pytest.raises(ValueError, match=match):
    testing.monte_carlo_bias(*args, **kwargs)


# --- the verdicts, confirmed by sampling from a softmax policy ----------------------------------
#
# A softmax policy over 3 labels, label 0 correct: pi = (p, 0.7 (1 - p), 0.3 (1 - p)). A group
# of n rollouts samples labels, its rewards are [label = 0], `sera_jax.advantages` gives their
# advantages, and its logit-space gradient is (1/n) sum_j A_j (onehot(a_j) - pi); grad log p
# is onehot(0) - pi.

MC_N = 8
MC_P = (0.05, 0.5, 0.9)
MC_DRAWS = 40_000
MC_FALSE_ALARM = 1e-4  # per call; 23 calls, so at most 2.3e-3 for the two tests together


def _group_gradients(name, params, p, rng):
  pi = np.array([p, 0.7 * (1 - p), 0.3 * (1 - p)])
  labels = rng.choice(3, size=(MC_DRAWS, MC_N), p=pi)
  rewards = (labels == 0).astype(np.float64)
  with jax.enable_x64(True):
    adv = np.asarray(sera_jax.advantages(rewards, np.ones(rewards.shape, bool), estimator=name,
                                         eps=EPS, **params))
  return np.einsum("dn,dnc->dc", adv, np.eye(3)[labels] - pi) / MC_N, np.eye(3)[0] - pi


def _samples(name):
  """Per p of MC_P: ([MC_DRAWS, 3] group gradients, grad log p), one seed per estimator."""
  rng = np.random.default_rng(sum(map(ord, name)))
  return [_group_gradients(name, testing.TABLE_PARAMS.get(name, {}), p, rng) for p in MC_P]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(estimators.registered_estimators()))
def test_expected_scale_agrees_with_sampling_at_three_points(name):
  samples = _samples(name)
  params = testing.TABLE_PARAMS.get(name, {})
  with jax.enable_x64(True):
    scales = np.asarray(estimators.expected_scale(name, np.log(MC_P), MC_N, eps=EPS,
                                                  **params))
  expected = np.concatenate([c * grad for c, (_, grad) in zip(scales, samples, strict=True)])
  report = testing.monte_carlo_bias(np.concatenate([g for g, _ in samples], axis=1), expected,
                                    false_alarm=MC_FALSE_ALARM)
  assert report.consistent, (name, str(report))


CLAIMS = [(name, claim) for name, entry in estimators.registered_estimators().items()
          for claim in entry.objectives]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "claim"), CLAIMS)
def test_sampling_confirms_the_verdict_at_three_points(name, claim):
  """Unbiased for J means c(p, n) / s_J(p) is one number at every p: the per-draw estimates
  <g, grad log p> / (|grad log p|^2 s_J(p)) at the three p share their mean. Their contrasts
  are directions fixed before drawing with expected value 0 exactly when that holds."""
  params = testing.TABLE_PARAMS.get(name, {})
  objective = estimators.resolve_objective(claim, MC_N, params)
  ratios = []
  for p, (gradients, grad) in zip(MC_P, _samples(name), strict=True):
    with jax.enable_x64(True):
      s = float(testing.objective_scale(objective, np.log(p)))
    ratios.append(gradients @ grad / (grad @ grad * s))
  report = testing.monte_carlo_bias(np.stack(ratios, axis=1), np.zeros(3),
                                    directions=[[1, -1, 0], [0, 1, -1], [1, 0, -1]],
                                    false_alarm=MC_FALSE_ALARM)
  verdict = testing.unbiasedness(name, claim, n=MC_N, **params)
  assert report.consistent == verdict.unbiased, (name, claim, str(report), str(verdict))


# --- the table of docs/testing_estimators.md --------------------------------------------------


def test_runs_name_consecutive_group_sizes():
  assert testing._runs([1, 3, 4, 5, 8]) == "1, 3..5, 8"
  assert testing._runs([2]) == "2"


@pytest.mark.slow
def test_the_docs_table_is_the_verdicts_the_library_computes():
  table = testing.verdict_table()
  assert table in DOCS.read_text(), f"regenerate the table in {DOCS.name}:\n{table}"
  # Every registered estimator is a row; a source's false claim is said as such.
  assert all(f"| `{name}`" in table for name in estimators.registered_estimators())
  assert "pass@k: biased at n = 4..16" in table


# Where maclaurin_baseline is unbiased for truncated@order, over orders and n = 1..16: order 1
# (no term of order k >= 2) at every n, and order 2 at n = 2 (whose order-2 term, k = n, has no
# other subset to share rollouts with).
MACLAURIN_BASELINE_UNBIASED = {(1, n) for n in testing.TABLE_NS} | {(2, 2)}


@pytest.mark.parametrize("order", [
    pytest.param(order, marks=[pytest.mark.slow] if order > 3 else []) for order in range(1, 17)])
def test_maclaurin_baseline_is_unbiased_exactly_at_order_1_and_at_order_2_with_n_2(order):
  unbiased = [n for n in testing.TABLE_NS if (order, n) in MACLAURIN_BASELINE_UNBIASED]
  biased = [n for n in testing.TABLE_NS if (order, n) not in MACLAURIN_BASELINE_UNBIASED]
  want = "; ".join(f"{kind} at n = {testing._runs(ns)}"
                   for kind, ns in (("unbiased", unbiased), ("biased", biased)) if ns)
  found = testing.verdicts(["maclaurin_baseline"], params={"maclaurin_baseline": {"order": order}})
  assert found == {"maclaurin_baseline": {"truncated@order": want}}


def test_verdicts_count_each_group_size_once():
  found = testing.verdicts(["grpo", "pkpo"], ns=range(1, 6))
  assert found == {"grpo": {"p": "unbiased at n = 2..3; biased at n = 4..5; no signal at n = 1"},
                   "pkpo": {"pass@k": "biased at n = 4..5; no signal at n = 1..3"}}
