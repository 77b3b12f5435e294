"""Tests of sera_jax.success: oracle, historical discounted Beta, pilot.

See docs/method.md#estimating-p.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from sera_jax.method.success import (
    HistoricalState,
    historical_estimate,
    historical_init,
    historical_population_log_p,
    historical_stage,
    historical_start_epoch,
    oracle_log_p,
    pilot_budget_split,
    pilot_log_p,
)

# --- oracle -----------------------------------------------------------------------------------


def test_oracle_equals_log_softmax_for_moderate_logits():
  rng = np.random.default_rng(0)
  logits = rng.normal(scale=3.0, size=(6, 5))
  labels = np.array([0, 4, 2, 2, 1, 3])
  probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
  got = oracle_log_p(jnp.asarray(logits, jnp.float32), jnp.asarray(labels))
  chex.assert_shape(got, (6,))
  np.testing.assert_allclose(got, np.log(probs[np.arange(6), labels]), rtol=1e-5)
  jitted = jax.jit(oracle_log_p)(jnp.asarray(logits, jnp.float32), jnp.asarray(labels))
  np.testing.assert_allclose(jitted, got, rtol=1e-6)


def test_oracle_never_underflows():
  logits = jnp.asarray([[1e4, 0.0, 0.0], [0.0, 1e4, -1e4]], jnp.float32)
  got = oracle_log_p(logits, jnp.asarray([1, 1]))
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, [-1e4, 0.0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("logits", "labels", "error", "match"),
    [
        (np.zeros((2, 3)), np.array([0, 3]), ValueError, r"labels must lie in \[0, 3\); found 3"),
        (np.zeros((2, 3)), np.array([0, 1, 2]), ValueError,
         r"labels must have shape \[M\] = \[2\]"),
        (np.zeros((2, 3)), np.array([0.0, 1.0]), TypeError, r"labels must be an integer array"),
        (np.zeros(3), np.array([0]), ValueError, r"logits must have rank 2"),
    ],
)
def test_oracle_rejects_bad_input(logits, labels, error, match):
  with pytest.raises(error, match=match):
    oracle_log_p(logits, labels)


# --- historical ---------------------------------------------------------------------------------


def _epoch_one_state():
  """4 prompts; epoch 1 rolls out prompts 0, 2 and 0 again (duplicates accumulate)."""
  state = historical_init(4)
  rewards = np.array([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0]])
  mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
  return historical_stage(state, np.array([0, 2, 0]), rewards, mask)


def test_historical_stage_and_fold_by_hand():
  state = _epoch_one_state()
  # prompt 0: (1 success, 2 failures) + (3 successes, 1 failure); prompt 2: 2 failures.
  np.testing.assert_array_equal(state.staged_successes, [4, 0, 0, 0])
  np.testing.assert_array_equal(state.staged_failures, [3, 0, 2, 0])
  np.testing.assert_array_equal(state.successes, 0)
  np.testing.assert_array_equal(state.seen, False)
  # Nothing is folded yet: no prompt has an estimate during the first epoch.
  _, has_estimate = historical_estimate(state, np.arange(4))
  np.testing.assert_array_equal(has_estimate, False)

  state = historical_start_epoch(state, discount=0.75)
  np.testing.assert_array_equal(state.successes, [4, 0, 0, 0])
  np.testing.assert_array_equal(state.failures, [3, 0, 2, 0])
  np.testing.assert_array_equal(state.staged_successes, 0)
  np.testing.assert_array_equal(state.staged_failures, 0)
  np.testing.assert_array_equal(state.seen, [True, False, True, False])
  log_p, has_estimate = historical_estimate(state, np.array([0, 1, 2, 3]))
  np.testing.assert_array_equal(has_estimate, [True, False, True, False])
  np.testing.assert_allclose(np.exp(log_p), [4.5 / 8, 0.5, 0.5 / 3, 0.5], rtol=1e-6)

  # Epoch 2: prompt 2 gets 1 success; prompt 0 is not rolled out and only decays.
  state = historical_stage(state, np.array([2]), np.array([[1, 0]]), np.array([[1, 0]]))
  state = historical_start_epoch(state, discount=0.75)
  np.testing.assert_allclose(state.successes, [3.0, 0, 1.0, 0], rtol=1e-6)
  np.testing.assert_allclose(state.failures, [2.25, 0, 1.5, 0], rtol=1e-6)
  log_p, _ = historical_estimate(state, np.array([0, 2]))
  np.testing.assert_allclose(log_p, np.log([3.5 / 6.25, 1.5 / 3.5]), rtol=1e-6)
  np.testing.assert_array_equal(state.seen, [True, False, True, False])


def test_historical_estimate_frozen_within_epoch():
  state = historical_start_epoch(_epoch_one_state())
  before, _ = historical_estimate(state, np.arange(4))
  state = historical_stage(state, np.array([0, 1, 3]), np.ones((3, 5)), np.ones((3, 5)))
  during, has_estimate = historical_estimate(state, np.arange(4))
  np.testing.assert_array_equal(during, before)
  np.testing.assert_array_equal(has_estimate, [True, False, True, False])
  after, has_estimate = historical_estimate(historical_start_epoch(state), np.arange(4))
  assert (np.asarray(after) != np.asarray(before)).all()
  np.testing.assert_array_equal(has_estimate, True)


def test_historical_log_space_and_prior():
  state = historical_start_epoch(_epoch_one_state(), discount=0.5)
  log_p, _ = historical_estimate(state, np.array([0, 2]), alpha0=1.0, beta0=2.0)
  np.testing.assert_allclose(log_p, np.log([5 / 10, 1 / 5]), rtol=1e-6)
  # Many failures: p is tiny but log p stays finite and < 0.
  state = historical_init(1)
  state = historical_stage(state, np.array([0]), np.zeros((1, 4096)), np.ones((1, 4096)))
  log_p, _ = historical_estimate(historical_start_epoch(state), np.array([0]))
  np.testing.assert_allclose(log_p, np.log(0.5 / 4097), rtol=1e-6)


def test_historical_is_jittable_and_x64():
  stage = jax.jit(historical_stage)
  fold = jax.jit(historical_start_epoch, static_argnames="discount")
  estimate = jax.jit(historical_estimate, static_argnames=("alpha0", "beta0"))
  rewards, mask = np.array([[1, 0]]), np.array([[1, 1]])
  state = fold(stage(historical_init(3), np.array([1]), rewards, mask), discount=0.75)
  log_p, has_estimate = estimate(state, np.array([1, 2]))
  np.testing.assert_allclose(log_p[0], np.log(1.5 / 3), rtol=1e-6)
  np.testing.assert_array_equal(has_estimate, [True, False])
  with jax.enable_x64(True):
    state = historical_init(3, dtype=jnp.float64)
    state = historical_start_epoch(historical_stage(state, np.array([1]), rewards, mask))
    log_p, _ = historical_estimate(state, np.array([1]))
    assert log_p.dtype == jnp.float64
    np.testing.assert_allclose(log_p, np.log(1.5 / 3), rtol=1e-15)


def test_historical_orbax_round_trip_is_bit_exact(tmp_path):
  rng = np.random.default_rng(1)
  state = historical_init(7)
  for _ in range(3):
    ids = rng.integers(0, 6, size=5)
    rewards = rng.integers(0, 2, size=(5, 3))
    state = historical_start_epoch(historical_stage(state, ids, rewards, np.ones((5, 3))),
                                   discount=0.75)
  state = historical_stage(state, np.array([6]), np.array([[1, 1, 0]]), np.ones((1, 3)))
  path = tmp_path / "historical"
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, state)
    checkpointer.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    restored = checkpointer.restore(path, abstract)
  assert isinstance(restored, HistoricalState)
  for name, want, got in zip(HistoricalState._fields, state, restored, strict=True):
    assert got.dtype == want.dtype and got.shape == want.shape, name
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), name


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda s: historical_stage(s, np.array([4]), np.ones((1, 2)), np.ones((1, 2))),
         ValueError, r"prompt_ids must lie in \[0, 4\); found 4"),
        (lambda s: historical_stage(s, np.array([0]), np.full((1, 2), 0.5), np.ones((1, 2))),
         ValueError, r"rewards must be binary"),
        (lambda s: historical_stage(s, np.array([0]), np.ones((1, 2)), np.full((1, 2), 3)),
         ValueError, r"mask must be boolean-like"),
        (lambda s: historical_stage(s, np.array([0, 1]), np.ones((1, 2)), np.ones((1, 2))),
         ValueError, r"prompt_ids must have shape \[M\] = \[1\]"),
        (lambda s: historical_stage(s, np.array([0.0]), np.ones((1, 2)), np.ones((1, 2))),
         TypeError, r"prompt_ids must be an integer array"),
        (lambda s: historical_start_epoch(s, discount=1.5), ValueError,
         r"discount must lie in \[0, 1\]; got 1.5"),
        (lambda s: historical_estimate(s, np.array([-1])), ValueError,
         r"prompt_ids must lie in \[0, 4\); found -1"),
        (lambda s: historical_estimate(s, np.array([0]), alpha0=0.0), ValueError,
         r"alpha0 must be > 0"),
        (lambda s: historical_init(0), ValueError, r"num_prompts must be >= 1"),
    ],
)
def test_historical_rejects_bad_input(call, error, match):
  with pytest.raises(error, match=match):
    call(historical_init(4))


# --- pilot ------------------------------------------------------------------------------------


def test_pilot_posterior_by_hand():
  got = pilot_log_p(np.array([0, 1, 4]), 4)
  np.testing.assert_allclose(np.exp(got), [0.5 / 5, 1.5 / 5, 4.5 / 5], rtol=1e-6)
  got = pilot_log_p(np.array([2]), 3, alpha0=1.0, beta0=1.0)
  np.testing.assert_allclose(got, np.log([3 / 5]), rtol=1e-6)
  assert (np.asarray(pilot_log_p(np.array([0, 8]), 8)) < 0).all()
  np.testing.assert_allclose(jax.jit(pilot_log_p, static_argnums=1)(np.array([0, 1, 4]), 4),
                             pilot_log_p(np.array([0, 1, 4]), 4), rtol=1e-6)


def test_pilot_budget_split():
  assert pilot_budget_split(8, 2) == 6
  assert pilot_budget_split(2, 1) == 1
  with pytest.raises(ValueError, match=r"num_pilot must be < baseline_n = 4.*got 4"):
    pilot_budget_split(4, 4)
  with pytest.raises(ValueError, match=r"num_pilot must be >= 1"):
    pilot_budget_split(4, 0)
  with pytest.raises(ValueError, match=r"successes must be integers in \[0, num_pilot = 2\]"):
    pilot_log_p(np.array([3]), 2)


def test_pilot_then_allocate_spends_the_budget_exactly():
  from sera_jax.method.allocation import allocate

  baseline_n, num_pilot = 8, 2
  pilot_successes = np.array([0, 1, 2, 2, 0, 1])
  log_p = pilot_log_p(pilot_successes, num_pilot)
  rest = pilot_budget_split(baseline_n, num_pilot)
  allocation = allocate(log_p, baseline_n=rest, n_min=2, n_max=4 * rest, mode="equalized")
  total = num_pilot * len(pilot_successes) + int(np.sum(allocation.counts))
  assert total == len(pilot_successes) * baseline_n
  # Hard prompts (no pilot success) get at least as many second-stage rollouts as easy ones.
  assert allocation.counts[0] >= allocation.counts[2]


def test_population_estimate_is_the_mean_p_of_the_seen_prompts():
  state = historical_init(4)
  log_p, any_seen = historical_population_log_p(state)
  assert not bool(any_seen)
  np.testing.assert_allclose(log_p, np.log(0.5))  # the prior mean before anything is seen
  state = state._replace(successes=jnp.array([3.0, 0.0, 9.0, 1.0]),
                         failures=jnp.array([1.0, 4.0, 0.0, 1.0]),
                         seen=jnp.array([True, True, False, True]))
  log_p, any_seen = jax.jit(historical_population_log_p)(state)
  want = np.mean([(0.5 + 3) / (1 + 4), 0.5 / (1 + 4), (0.5 + 1) / (1 + 2)])
  assert bool(any_seen)
  np.testing.assert_allclose(log_p, np.log(want), rtol=1e-6)
