"""Tests of sera_jax.estimators: advantages, their exact scales, the loss.

See docs/method.md#the-estimator-and-its-scale and docs/method.md#weights-and-the-loss.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from scipy import stats

from sera_jax.method import scaling
from sera_jax.method.estimators import ESTIMATORS, advantages, expected_scale, policy_loss

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
  # below float32 rounding, and 4 standard errors must measure sampling, not rounding.
  with jax.enable_x64(True):
    key = jax.random.fold_in(jax.random.key(0), 1000 * n + int(1000 * p))
    samples = np.asarray(_projected_group_gradients(key, jnp.float64(p), jnp.float64(n)))
    for estimator, sample in zip(ESTIMATORS, samples, strict=True):
      mean = sample.mean()
      stderr = sample.std(ddof=1) / np.sqrt(NUM_GROUPS)
      want = float(expected_scale(estimator, np.log(p), n, eps=EPS))
      assert stderr > 0, (estimator, p, n)
      assert abs(mean - want) <= 4 * stderr, (estimator, p, n, mean, want, stderr)


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
