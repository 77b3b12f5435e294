"""Tests of sera_jax.estimators: advantages, their exact scales, the loss.

See docs/method.md#the-estimator-and-its-scale and docs/method.md#weights-and-the-loss.
"""

import functools
import importlib.util
import math
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from scipy import stats

import sera_jax
from sera_jax.method import estimators, scaling
from sera_jax.method.estimators import ESTIMATORS, advantages, expected_scale, policy_loss
from sera_jax.testing import monte_carlo_bias

EPS = 1e-6

# Three groups padded to N = 4: n = 3 with K = 1, n = 4 with K = 2, n = 2 with K = 0.
REWARDS = np.array([[1, 0, 0, 1], [1, 1, 0, 0], [0, 0, 1, 1]], np.float32)
MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], bool)


def _by_hand(estimator: str) -> np.ndarray:
  """The docs/method.md#the-estimator-and-its-scale formulas written out per group, in float64."""
  out = np.zeros(REWARDS.shape)
  for q in range(REWARDS.shape[0]):
    r = REWARDS[q, MASK[q]].astype(np.float64)
    n, k = len(r), r.sum()
    mu = k / n
    if estimator == "maxrl":
      a = (r - mu) / (mu + EPS) if k > 0 else 0 * r
    elif estimator == "maxrl_plain":
      a = r / (mu + EPS) if k > 0 else 0 * r
    elif estimator == "grpo":
      a = (r - mu) / (r.std() + EPS)
    elif estimator == "grpo_sample_std":
      a = (r - mu) / ((r.std(ddof=1) if n > 1 else 0.0) + EPS)
    elif estimator == "rloo":
      a = r - (k - r) / (n - 1)
    else:
      a = r - mu
    out[q, MASK[q]] = a
  return out


class AdvantagesTest(parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*ESTIMATORS)
  def test_matches_hand_computation(self, estimator):
    fn = self.variant(functools.partial(advantages, estimator=estimator, eps=EPS))
    got = fn(jnp.asarray(REWARDS), jnp.asarray(MASK))
    chex.assert_shape(got, REWARDS.shape)
    self.assertEqual(got.dtype, jnp.float32)
    np.testing.assert_allclose(got, _by_hand(estimator), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got)[~MASK], 0.0)

  def test_hand_values(self):
    # Group 0: n = 3, K = 1, mu = 1/3.
    got = advantages(REWARDS, MASK, estimator="maxrl", eps=0.0)
    np.testing.assert_allclose(got[0], [2.0, -1.0, -1.0, 0.0], rtol=1e-6)
    got = advantages(REWARDS, MASK, estimator="maxrl_plain", eps=0.0)
    np.testing.assert_allclose(got[0], [3.0, 0.0, 0.0, 0.0], rtol=1e-6)
    got = advantages(REWARDS, MASK, estimator="grpo", eps=0.0)
    np.testing.assert_allclose(got[0], [np.sqrt(2), -1 / np.sqrt(2), -1 / np.sqrt(2), 0], rtol=1e-6)
    # Sample variance n mu (1 - mu) / (n - 1) = (3/2)(2/9) = 1/3.
    got = advantages(REWARDS, MASK, estimator="grpo_sample_std", eps=0.0)
    third = np.sqrt(1 / 3)
    np.testing.assert_allclose(got[0], [(2 / 3) / third, -(1 / 3) / third, -(1 / 3) / third, 0],
                               rtol=1e-6)
    got = advantages(REWARDS, MASK, estimator="rloo")
    np.testing.assert_allclose(got[0], [1.0, -0.5, -0.5, 0.0], rtol=1e-6)
    got = advantages(REWARDS, MASK, estimator="reinforce")
    np.testing.assert_allclose(got[1], [0.5, 0.5, -0.5, -0.5], rtol=1e-6)

  @parameterized.parameters(*ESTIMATORS)
  def test_degenerate_groups_give_zero(self, estimator):
    rewards = np.array([[0, 0, 0], [1, 1, 1], [1, 0, 1], [1, 0, 0]], np.float32)
    mask = np.array([[1, 1, 1], [1, 1, 1], [0, 0, 0], [1, 0, 0]], bool)
    got = np.asarray(advantages(rewards, mask, estimator=estimator))
    np.testing.assert_array_equal(got[0], 0.0)  # K = 0 (both MaxRL forms: explicitly)
    np.testing.assert_array_equal(got[2], 0.0)  # n = 0
    if estimator in ("maxrl", "grpo", "grpo_sample_std", "reinforce"):
      np.testing.assert_array_equal(got[1], 0.0)  # K = n: nothing to center
    if estimator != "maxrl_plain":
      np.testing.assert_array_equal(got[3], 0.0)  # n = 1: no other rollout to compare with
    assert np.isfinite(got).all()

  def test_a_group_of_one_rollout_gets_0(self):
    # docs/testing_estimators.md#a-group-of-one-rollout: the MaxRL repository gives the first
    # rollout 1e6 (its maxrl), 1 / (1 + 1e-6) (its GRPO) or 1 (its RLOO and Dr. GRPO).
    rewards, prompts = np.array([1.0, 1.0, 0.0], np.float32), np.array([0, 1, 1], np.int32)
    for estimator in ("maxrl", "grpo", "grpo_sample_std", "reinforce", "drgrpo", "rloo"):
      got = np.asarray(sera_jax.flat_advantages(rewards, prompts, num_prompts=2,
                                                estimator=estimator, eps=EPS))
      self.assertEqual(got[0], 0.0, estimator)
      if estimator == "maxrl":
        np.testing.assert_allclose(got, [0.0, 0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS)], rtol=1e-6)

  def test_accepts_int_and_bool_inputs(self):
    got = advantages(REWARDS.astype(np.int32), MASK.astype(np.int32))
    np.testing.assert_allclose(got, _by_hand("maxrl"), rtol=1e-6, atol=1e-6)

  def test_exact_under_x64(self):
    with jax.enable_x64(True):
      got = advantages(REWARDS.astype(np.float64), MASK, estimator="grpo", eps=EPS)
      self.assertEqual(got.dtype, jnp.float64)
      np.testing.assert_allclose(got, _by_hand("grpo"), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(rewards=[[0.5, 1.0]], mask=[[1, 1]]), r"rewards must be binary.*0\.5"),
        (dict(rewards=[[1.0, 0.0]], mask=[[1, 2]]), r"mask must be boolean-like.*2"),
        (dict(rewards=[[1.0, 0.0]], mask=[[1, 1, 1]]), r"shape mismatch: rewards \(1, 2\), mask"),
        (dict(rewards=[1.0, 0.0], mask=[1, 1]), r"rewards must have rank 2"),
        (dict(rewards=[[1.0]], mask=[[1]], estimator="ppo"), r"estimator must be one of.*'ppo'"),
    ],
)
def test_advantages_rejects_bad_input(kwargs, match):
  with pytest.raises(ValueError, match=match):
    advantages(**kwargs)


# --- expected_scale: closed forms ------------------------------------------------------------

def test_expected_scale_closed_forms_x64():
  with jax.enable_x64(True):
    p = np.concatenate([np.geomspace(1e-3, 0.5, 12), 1 - np.geomspace(0.5, 1e-3, 12)[1:]])
    log_p = jnp.log(jnp.asarray(p))[:, None]
    n = jnp.asarray([1, 2, 3, 4, 7, 8, 16, 31, 64, 100, 128, 255, 256, 511, 512])[None, :]
    closed = {
        "maxrl": scaling.fidelity(log_p, n),
        "maxrl_plain": scaling.coverage(log_p, n),
        "reinforce": (1 - 1 / n) * jnp.exp(log_p),
        "rloo": jnp.where(n >= 2, jnp.exp(log_p), 0.0),
    }
    for estimator, want in closed.items():
      got = expected_scale(estimator, log_p, n, eps=0.0)
      assert got.dtype == jnp.float64 and got.shape == want.shape
      np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15, err_msg=estimator)


@pytest.mark.parametrize("estimator", ["grpo", "grpo_sample_std"])
def test_grpo_expected_scales_equal_the_binomial_sum_written_out(estimator):
  """c(p, n) = (1/n) sum_K Binom(K; n, p) [K a_s(K) - (n - K) a_f(K) p / (1 - p)] summed term by
  term in float64 with each GRPO's advantages written out.

  The closed form is that of docs/method.md#the-estimator-and-its-scale.
  """
  def advantage(r, n, k):
    if not 0 < k < n:  # a group with nothing to center (n = 1 among them)
      return 0.0
    mu = k / n
    var = mu * (1 - mu) * (n / (n - 1) if estimator == "grpo_sample_std" else 1.0)
    return (r - mu) / (np.sqrt(var) + EPS)

  with jax.enable_x64(True):
    for p in (1e-3, 0.05, 0.3, 0.5, 0.9):
      for n in (1, 2, 3, 8, 64):
        want = sum(stats.binom.pmf(k, n, p) * (k * advantage(1, n, k)
                                               - (n - k) * advantage(0, n, k) * p / (1 - p))
                   for k in range(n + 1)) / n
        got = expected_scale(estimator, np.log(p), n, eps=EPS)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-14, err_msg=(p, n))
    # The sample std is the larger: the ddof = 1 scale is the smaller, by up to sqrt((n-1)/n).
    log_p = np.log(np.asarray([0.05, 0.5]))
    ratio = expected_scale("grpo_sample_std", log_p, 8) / expected_scale("grpo", log_p, 8)
    assert np.all((np.sqrt(7 / 8) - 1e-6 <= ratio) & (ratio < 1))


@pytest.mark.slow
def test_expected_scale_edge_cases():
  with jax.enable_x64(True):
    for estimator in ESTIMATORS:
      got = expected_scale(estimator, jnp.log(jnp.asarray([0.3, 0.3, 1.0])), [0, 1, 5])
      assert got[0] == 0.0  # n = 0
      assert np.isfinite(got).all()
    # One rollout carries no signal for centered MaxRL; p = 1 (no failure possible) is finite.
    assert expected_scale("maxrl", np.log(0.3), 1) == 0.0
    np.testing.assert_allclose(expected_scale("maxrl", 0.0, 5, eps=0.0), 1.0, rtol=1e-15)
    # eps > 0 shrinks the MaxRL scale a little; GRPO has a finite positive scale.
    assert expected_scale("maxrl", np.log(0.3), 8) < scaling.fidelity(np.log(0.3), 8)
    assert 0 < expected_scale("grpo", np.log(0.3), 8) < 8


def test_expected_scale_jit_needs_static_max_n():
  log_p = jnp.log(jnp.asarray([0.1, 0.5, 0.9]))
  n = jnp.asarray([2, 8, 64])
  eager = expected_scale("maxrl", log_p, n)
  jitted = jax.jit(functools.partial(expected_scale, "maxrl", max_n=64))(log_p, n)
  np.testing.assert_allclose(jitted, eager, rtol=1e-6)
  np.testing.assert_allclose(eager, scaling.fidelity(log_p, n), rtol=1e-4)
  with pytest.raises(ValueError, match="max_n is required"):
    jax.jit(functools.partial(expected_scale, "maxrl"))(log_p, n)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (("maxrl", 0.1, 2), {}, r"log_p must hold finite log-probabilities <= 0.*positive"),
        (("maxrl", -jnp.inf, 2), {}, r"log_p.*-inf"),
        (("maxrl", jnp.nan, 2), {}, r"log_p.*NaN"),
        (("maxrl", -1.0, -1), {}, r"n must hold integers >= 0"),
        (("maxrl", -1.0, 2.5), {}, r"n must hold integers >= 0"),
        (("maxrl", -1.0, 8), {"max_n": 4}, r"max_n = 4 is smaller than max\(n\) = 8"),
        (("dr_grpo", -1.0, 2), {}, r"estimator must be one of.*'dr_grpo'"),
    ],
)
def test_expected_scale_rejects_bad_input(args, kwargs, match):
  with pytest.raises(ValueError, match=match):
    expected_scale(*args, **kwargs)


# --- expected_scale: Monte Carlo on a toy policy -----------------------------------------------
#
# A softmax policy over 3 labels, label 0 correct: pi = (p, 0.7 (1 - p), 0.3 (1 - p)). The
# logit-space score of a sampled label a is S_a = onehot(a) - pi and grad log p = onehot(0) - pi.
# Each group draws K ~ Binomial(n, p) successes and, among its n - K failures, F1 ~
# Binomial(n - K, 0.7) of label 1 (the rest label 2). Every estimator gives all successes of a
# group one advantage a_s(K) and all failures one a_f(K), read off `advantages` itself on a table
# with one group per K, so the group gradient (1/n) sum_j A_j S_j is
# (K a_s(K) S_0 + a_f(K) (F1 S_1 + F2 S_2)) / n, projected on grad log p / |grad log p|^2.

NUM_GROUPS = 100_000
MAX_N = 64


@jax.jit
def _projected_group_gradients(key, p, n):
  """[len(ESTIMATORS), NUM_GROUPS] projected group gradients, one shared sample of groups."""
  key_k, key_f = jax.random.split(key)
  pi = jnp.stack([p, 0.7 * (1 - p), 0.3 * (1 - p)])
  grad_log_p = jnp.eye(3)[0] - pi
  score = jnp.eye(3) - pi  # row a: score of label a
  projected = score @ grad_log_p / jnp.dot(grad_log_p, grad_log_p)  # [3]
  k = jax.random.binomial(key_k, n, p, shape=(NUM_GROUPS,))
  f1 = jax.random.binomial(key_f, n - k, 0.7)
  f2 = n - k - f1
  # Row K of the table: a group of n rollouts (MAX_N slots, masked) whose first K succeed.
  slot = jnp.arange(MAX_N)
  table_rewards = (slot[None, :] < jnp.arange(MAX_N + 1)[:, None]).astype(p.dtype)
  table_mask = jnp.broadcast_to(slot < n, table_rewards.shape)
  rows = k.astype(jnp.int32)
  last = n.astype(jnp.int32) - 1
  gradients = []
  for estimator in ESTIMATORS:
    table = advantages(table_rewards, table_mask, estimator=estimator, eps=EPS)
    a_success = table[rows, 0]  # slot 0 succeeds whenever K >= 1
    a_failure = table[rows, last]  # slot n - 1 fails whenever K < n
    gradients.append((k * a_success * projected[0]
                      + a_failure * (f1 * projected[1] + f2 * projected[2])) / n)
  return jnp.stack(gradients)


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 8, 64])
@pytest.mark.parametrize("p", [1e-3, 0.05, 0.5, 0.95])
def test_expected_scale_matches_monte_carlo(p, n):
  # float64 throughout: some estimators (plain MaxRL at K > 0) have a per-group spread far
  # below float32 rounding, and the z-scores must measure sampling, not rounding.
  with jax.enable_x64(True):
    key = jax.random.fold_in(jax.random.key(0), 1000 * n + int(1000 * p))
    samples = np.asarray(_projected_group_gradients(key, jnp.float64(p), jnp.float64(n)))
    want = [float(expected_scale(estimator, np.log(p), n, eps=EPS)) for estimator in ESTIMATORS]
  assert np.all(samples.std(axis=1) > 0), (p, n)
  # A column per estimator, each its own direction; a false alarm at most 1e-4 a (p, n),
  # so at most 1.2e-3 over the 12 cases.
  report = monte_carlo_bias(samples.T, want, directions=np.eye(len(want)), false_alarm=1e-4)
  assert report.consistent, (ESTIMATORS[report.worst], p, n, str(report))


# --- policy_loss ----------------------------------------------------------------------------

def test_policy_loss_value_and_gradient():
  rng = np.random.default_rng(0)
  log_probs = jnp.asarray(-rng.exponential(size=REWARDS.shape), jnp.float32)
  adv = advantages(REWARDS, MASK)
  weights = jnp.asarray([2.0, 0.5, 1.0])
  baseline_n = 4
  num_prompts = REWARDS.shape[0]
  loss, (grad_log_probs, grad_adv) = jax.value_and_grad(policy_loss, argnums=(0, 1))(
      log_probs, adv, MASK, weights, baseline_n)
  want_grad = -(weights[:, None] * adv * MASK) / (num_prompts * baseline_n)
  np.testing.assert_allclose(grad_log_probs, want_grad, rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(grad_adv, 0.0)  # advantages are stop-gradient
  np.testing.assert_allclose(loss, jnp.sum(want_grad * log_probs), rtol=1e-6)
  jitted = jax.jit(policy_loss, static_argnums=4)(log_probs, adv, MASK, weights, baseline_n)
  np.testing.assert_allclose(jitted, loss, rtol=1e-6)


def test_policy_loss_ignores_padded_slots():
  log_probs = jnp.where(jnp.asarray(MASK), -1.0, jnp.nan)
  adv = advantages(REWARDS, MASK)
  loss, grad = jax.value_and_grad(policy_loss)(log_probs, adv, MASK, jnp.ones(3), 4)
  assert np.isfinite(loss) and np.isfinite(grad).all()


@pytest.mark.parametrize(
    ("weights", "baseline_n", "mask", "error", "match"),
    [
        (np.ones(2), 4, MASK, ValueError, r"weights must have shape \[M\] = \[3\]"),
        (np.ones(3), 0, MASK, ValueError, r"baseline_n must be >= 1"),
        (np.ones(3), 4.0, MASK, TypeError, r"baseline_n must be an int"),
        (np.ones(3), 4, MASK[:, :2], ValueError, r"shape mismatch"),
    ],
)
def test_policy_loss_rejects_bad_input(weights, baseline_n, mask, error, match):
  with pytest.raises(error, match=match):
    policy_loss(jnp.zeros(REWARDS.shape), jnp.zeros(REWARDS.shape), mask, weights, baseline_n)


# --- estimators as values: the registry, the peers' formulas, user functions ------------------
#
# Every registered estimator is checked at these parameters (two values of each parameter).

PARAMS = {"maclaurin": ({"order": 3}, {"order": 8}),
          "maclaurin_baseline": ({"order": 3}, {"order": 12}),
          "pkpo": ({"k": 1}, {"k": 4})}
CASES = [(name, params) for name in estimators.registered_estimators()
         for params in PARAMS.get(name, ({},))]
CASE_IDS = [name + "".join(f"-{key}{value}" for key, value in params.items())
            for name, params in CASES]


def _peer_by_hand(name, r, n, successes, **params):
  """The peers' advantage of one rollout written out from their sources, with math.comb."""
  mu = successes / n
  f = n - successes
  if name == "drgrpo":
    return r - mu if n >= 2 else 0.0
  if name == "one_sided_grpo":
    return (r - mu) / (np.sqrt(mu) + EPS)
  if name == "clipped_pnorm":
    mu = mu if n > 1 else 0.0  # the source's mean of a one-rollout group
    return (r - mu) / max(mu, 0.125) / n
  if name == "maxrl_std":
    return (r - mu) / (np.sqrt(mu * (1 - mu)) + EPS) / (mu + EPS)
  if name == "maclaurin":
    order = params["order"]
    if r:
      return 1 / n
    return -sum(math.comb(f - 1, j - 1) / math.comb(n - 1, j - 1)
                for j in range(2, min(order, f) + 1)) / n
  if name == "maclaurin_baseline":
    order = params["order"]
    success, failure = 1 / n, 0.0
    for j in range(2, min(order, n - 1) + 1):
      ratio = math.comb(f, j) / (math.comb(n, j) - 1)
      success += ratio / n
      failure += ratio * (1 / n - 1 / f) if f else 0.0
    if order >= n >= 2 and f == n:
      failure -= 1 / n
    return success if r else failure
  assert name == "pkpo"
  order = params["k"]
  if n < order:
    return 0.0
  share = math.comb(f, order - 1) / math.comb(n - 1, order - 1)
  return r * share if n == 1 else (n * r * share - successes * share) / (n - 1)


# Ragged groups padded to 7: n = 1 (K = 1 and K = 0), n = 2, n = 5 with K = 3, 0 and 5, n = 7.
RAGGED = [[1], [0], [1, 0], [1, 1, 0, 0, 1], [0] * 5, [1] * 5, [1, 0, 1, 0, 0, 0, 1]]
RAGGED_REWARDS = np.array([g + [0] * (7 - len(g)) for g in RAGGED], np.float32)
RAGGED_MASK = np.array([[j < len(g) for j in range(7)] for g in RAGGED])


class RegisteredEstimatorsTest(parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*[case for case in CASES if case[0] not in ESTIMATORS])
  def test_peer_formulas_match_their_sources_on_ragged_groups(self, name, params):
    fn = self.variant(functools.partial(advantages, estimator=name, eps=EPS, **params))
    got = np.asarray(fn(jnp.asarray(RAGGED_REWARDS), jnp.asarray(RAGGED_MASK)))
    want = np.zeros(RAGGED_REWARDS.shape)
    for q, group in enumerate(RAGGED):
      want[q, :len(group)] = [_peer_by_hand(name, r, len(group), sum(group), **params)
                              for r in group]
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6, err_msg=name)
    assert np.all(got[~RAGGED_MASK] == 0)


@pytest.mark.slow
class ExpectedScaleOfEveryEstimatorTest(parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*CASES)
  def test_expected_scale_of_every_estimator_jits(self, name, params):
    log_p = jnp.log(jnp.asarray([1e-3, 0.2, 0.5, 0.97]))[:, None]
    n = jnp.arange(0, 9)[None, :]
    fn = self.variant(functools.partial(expected_scale, name, max_n=8, **params))
    got = fn(log_p, n)
    chex.assert_shape(got, (4, 9))
    assert np.isfinite(got).all() and np.all(got[:, 0] == 0)
    np.testing.assert_allclose(got, expected_scale(name, log_p, n, **params), rtol=1e-6,
                               atol=1e-7)


@pytest.mark.parametrize(("name", "params"), CASES, ids=CASE_IDS)
def test_flat_buffers_give_the_padded_advantages(name, params):
  rewards, mask = RAGGED_REWARDS, RAGGED_MASK
  flat = sera_jax.flat_advantages(rewards[mask], np.nonzero(mask)[0].astype(np.int32),
                                  num_prompts=len(RAGGED), estimator=name, **params)
  padded = advantages(rewards, mask, estimator=name, **params)
  np.testing.assert_allclose(flat, np.asarray(padded)[mask], rtol=2.5e-7, atol=1e-7)


def _every_reward_pattern(max_n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Every 0/1 pattern of every group size n <= max_n, padded to max_n: rewards, mask, n."""
  rewards, mask, sizes = [], [], []
  for n in range(1, max_n + 1):
    bits = (np.arange(2**n)[:, None] >> np.arange(n)) & 1
    rewards.append(np.pad(bits, ((0, 0), (0, max_n - n))))
    mask.append(np.broadcast_to(np.arange(max_n) < n, (2**n, max_n)))
    sizes.append(np.full(2**n, n))
  return (np.concatenate(rewards).astype(np.float64), np.concatenate(mask),
          np.concatenate(sizes))


ENUMERATED_N = 12
ENUMERATED_P = (1e-3, 0.05, 0.3, 0.5, 0.7, 0.95, 0.999)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "params"), CASES, ids=CASE_IDS)
def test_expected_scale_equals_the_enumeration_of_every_reward_pattern(name, params, capsys):
  """c(p, n) = E[(1/n) sum_j A_j S_j] / grad log p, summed over all 2^n patterns of n <= 12:
  a pattern has probability p^K (1 - p)^(n - K), its advantages come from `advantages`, and
  E[S_j | r_j] is grad log p for a success and -p / (1 - p) grad log p for a failure."""
  rewards, mask, sizes = _every_reward_pattern(ENUMERATED_N)
  successes = rewards.sum(1)
  worst = 0.0
  with jax.enable_x64(True):
    adv = np.asarray(advantages(rewards, mask, estimator=name, eps=EPS, **params))
    for p in ENUMERATED_P:
      mean_score = np.where(rewards > 0, 1.0, -p / (1 - p)) * mask
      probability = p**successes * (1 - p)**(sizes - successes)
      want = np.bincount(sizes - 1, weights=probability * (adv * mean_score).sum(1) / sizes)
      got = np.asarray(expected_scale(name, np.log(p), np.arange(1, ENUMERATED_N + 1), eps=EPS,
                                      **params))
      worst = max(worst, float(np.max(np.abs(got - want))))
      np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=(name, params, p))
  with capsys.disabled():
    print(f"\n{name} {params}: largest |expected_scale - enumeration| = {worst:.1e}")


def _maclaurin_baseline_scale(p, n, order):
  terms = 1 + sum(math.comb(n, j) * (n - j) / (n * (math.comb(n, j) - 1)) * (1 - p)**(j - 1)
                  for j in range(2, min(order, n - 1) + 1))
  return p / n * (terms + ((1 - p)**(n - 1) if order >= n >= 2 else 0))


def _pkpo_scale(p, n, k):
  if n < k:
    return 0 * p
  if n == 1:
    return p
  return p * (1 - p)**(k - 2) * ((1 - p) + (k - 1) * p / (n - 1))


# The closed forms the registry states (`EstimatorEntry.scale`), written out: c(p, n) at eps = 0.
CLOSED_FORMS = {
    "maxrl": lambda p, n: 1 - (1 - p)**(n - 1),
    "maxrl_plain": lambda p, n: 1 - (1 - p)**n,
    "rloo": lambda p, n: p if n >= 2 else 0 * p,
    "reinforce": lambda p, n: (1 - 1 / n) * p,
    "drgrpo": lambda p, n: (1 - 1 / n) * p,
    "maclaurin": lambda p, n, order: (1 - (1 - p)**min(order, n)) / n,
    "maclaurin_baseline": _maclaurin_baseline_scale,
    "pkpo": _pkpo_scale,
}


def test_every_stated_closed_form_is_written_out_here():
  stated = {name for name, entry in estimators.registered_estimators().items() if entry.scale}
  assert stated == set(CLOSED_FORMS)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "params"), [case for case in CASES if case[0] in CLOSED_FORMS],
                         ids=[i for i, case in zip(CASE_IDS, CASES, strict=True)
                              if case[0] in CLOSED_FORMS])
def test_the_stated_closed_forms_equal_expected_scale(name, params):
  p = np.concatenate([np.geomspace(1e-4, 0.5, 9), 1 - np.geomspace(0.5, 1e-4, 9)[1:]])
  sizes = np.arange(1, 17)
  with jax.enable_x64(True):
    got = np.asarray(expected_scale(name, np.log(p)[:, None], sizes, eps=0.0, **params))
  for column, n in enumerate(sizes.tolist()):
    np.testing.assert_allclose(got[:, column], CLOSED_FORMS[name](p, n, **params), rtol=1e-10,
                               atol=1e-15, err_msg=(name, params, n))


def test_the_registry_holds_seras_estimators_each_with_a_source():
  registry = sera_jax.registered_estimators()
  assert set(ESTIMATORS) <= set(registry)
  assert {"drgrpo", "maclaurin", "maclaurin_baseline", "pkpo", "one_sided_grpo",
          "clipped_pnorm", "maxrl_std"} <= set(registry)
  for name, entry in registry.items():
    assert entry.name == name and entry.source and entry.formula
    for objective in entry.objectives:
      estimators.resolve_objective(objective, 8, {"order": 8, "k": 4})
  with pytest.raises(TypeError):
    registry["ppo"] = registry["maxrl"]  # read-only


def test_an_estimator_and_its_parameters_compile_once():
  traces = []

  def scaled(reward, group_size, successes, *, weight):
    traces.append(weight)  # runs when jit traces, not when the compiled program runs
    return weight * (reward - successes / group_size)

  for _ in range(3):
    got = advantages(REWARDS, MASK, estimator=scaled, weight=2.0)
  assert traces == [2.0]
  np.testing.assert_allclose(got, 2 * _by_hand("reinforce"), rtol=1e-6, atol=1e-6)
  advantages(REWARDS, MASK, estimator=scaled, weight=3.0)
  assert traces == [2.0, 3.0]
  for call in (functools.partial(expected_scale, scaled, np.log(0.3), 4, weight=2.0),
               functools.partial(sera_jax.flat_advantages, [1.0, 0.0], [0, 0], num_prompts=1,
                                 estimator=scaled, weight=2.0)):
    call()
    traced = len(traces)
    call()
    call()
    assert len(traces) == traced
  assert estimators.estimator_spec("pkpo", k=4) == estimators.estimator_spec("pkpo", k=np.int64(4))
  assert estimators.estimator_spec("pkpo", k=4) != estimators.estimator_spec("pkpo", k=3)
  # Equal values of other types are other parameters: jit traces (and checks) them anew.
  assert estimators.estimator_spec("pkpo", k=4) != estimators.estimator_spec("pkpo", k=4.0)
  advantages(REWARDS, MASK, estimator="pkpo", k=4)
  with pytest.raises(TypeError, match="k must be an int"):
    advantages(REWARDS, MASK, estimator="pkpo", k=4.0)
  spec = estimators.estimator_spec("maclaurin", order=8)
  assert hash(spec) == hash(estimators.estimator_spec("maclaurin", order=8))
  assert str(spec) == "maclaurin(order=8)"
  np.testing.assert_array_equal(advantages(REWARDS, MASK, estimator=spec),
                                advantages(REWARDS, MASK, estimator="maclaurin", order=8))


def test_a_user_function_with_var_positional_arguments_takes_its_keyword_parameters():
  def scaled(*args, scale=1.0):
    reward, group_size, successes = args
    return scale * (reward - successes / group_size)

  np.testing.assert_allclose(advantages(REWARDS, MASK, estimator=scaled, scale=2.0),
                             2 * _by_hand("reinforce"), rtol=1e-6, atol=1e-6)
  assert str(estimators.estimator_spec(scaled, scale=2.0)) == "scaled(scale=2.0)"


def test_a_user_function_takes_eps_when_it_asks_for_it():
  def centered(reward, group_size, successes, eps):
    mean = successes / group_size
    return jnp.where(successes > 0, (reward - mean) / (mean + eps), 0.0)

  for eps in (1e-6, 0.5):
    np.testing.assert_allclose(advantages(REWARDS, MASK, estimator=centered, eps=eps),
                               advantages(REWARDS, MASK, estimator="maxrl", eps=eps), rtol=1e-6)
    with jax.enable_x64(True):
      np.testing.assert_allclose(expected_scale(centered, np.log(0.2), 6, eps=eps),
                                 expected_scale("maxrl", np.log(0.2), 6, eps=eps), rtol=1e-12)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(estimator="pkpo"), TypeError, r"'pkpo' needs the keyword parameter\(s\) k"),
    (dict(estimator="pkpo", k=2, order=3), TypeError, r"'pkpo' has no parameter 'order'"),
    (dict(estimator="maclaurin", order=np.array(3)), TypeError, r"static .* order must be a "
     r"hashable value"),
    (dict(estimator="maclaurin", order=0), ValueError, r"order must be >= 1"),
    (dict(estimator="pkpo", k=2.0), TypeError, r"k must be an int"),
    (dict(estimator=lambda r, n: r), TypeError, r"a\(reward, group_size, successes, \*\*params\)"),
    (dict(estimator=3), TypeError, r"a registered name or a function"),
    (dict(estimator="dr_grpo"), ValueError, r"estimator must be one of .*'drgrpo'.*'dr_grpo'"),
])
def test_estimator_arguments_are_checked(kwargs, error, match):
  with pytest.raises(error, match=match):
    advantages(REWARDS, MASK, **kwargs)


@pytest.fixture
def registry(monkeypatch):
  """The registry, restored after the test."""
  monkeypatch.setattr(estimators, "_REGISTRY", dict(estimators._REGISTRY))
  return estimators


def _halved_rloo(reward, group_size, successes, *, scale=0.5):
  return scale * jnp.where(group_size > 1, reward - (successes - reward) / (group_size - 1), 0.0)


def test_a_registered_estimator_is_used_by_name(registry):
  sera_jax.register_estimator("halved_rloo", _halved_rloo, source="this test",
                              objectives=("p",), formula="RLOO / 2", scale="p / 2")
  entry = sera_jax.registered_estimators()["halved_rloo"]
  assert entry.source == "this test" and entry.objectives == ("p",)
  np.testing.assert_allclose(advantages(REWARDS, MASK, estimator="halved_rloo"),
                             0.5 * _by_hand("rloo"), rtol=1e-6)
  np.testing.assert_allclose(expected_scale("halved_rloo", np.log(0.3), 5, scale=0.25), 0.075,
                             rtol=1e-5)
  sera_jax.register_estimator("halved_rloo", _halved_rloo, source="this test, again")
  assert sera_jax.registered_estimators()["halved_rloo"].source == "this test, again"


@pytest.mark.parametrize(("name", "kwargs", "match"), [
    ("maxrl", dict(source="x"), r"'maxrl' is registered already"),
    ("mine", dict(source=" "), r"source must say where the formula comes from"),
    ("mine", dict(source="x", objectives=("likelihood",)), r"objective must be"),
    ("mine", dict(source="x", objectives=("pass@k",)), r"names the parameter 'k'"),
])
def test_registration_is_checked(registry, name, kwargs, match):
  with pytest.raises(ValueError, match=match):
    sera_jax.register_estimator(name, _halved_rloo, **kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(source=None), r"^source must be a string; got None\.$"),
    (dict(source="x", objectives="log_p"), r"^objectives must be a sequence of objectives, "
                                           r"e\.g\. \('log_p',\); got the string 'log_p'\.$"),
])
def test_registration_refuses_arguments_of_the_wrong_type(registry, kwargs, match):
  with pytest.raises(TypeError, match=match):
    sera_jax.register_estimator("mine", _halved_rloo, **kwargs)


@pytest.mark.slow
def test_the_scale_benchmark_times_the_name_and_the_function_alike():
  path = pathlib.Path(__file__).parents[1] / "benchmarks" / "estimator_scale.py"
  spec = importlib.util.spec_from_file_location("estimator_scale", path)
  benchmark = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(benchmark)
  result = benchmark.measure(prompts=64, max_n=8, repeats=1)
  assert result["max_relative_difference"] < 1e-6
  assert result["name_s"] > 0 and result["function_s"] > 0
