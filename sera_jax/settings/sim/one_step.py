"""A one-step environment whose success probability is known in closed form.

Scenario q shows its threshold t_q (drawn uniform in [-2.5, 2.5] from its key) as the
observation; an episode is one action a, and it succeeds when a_0 > t_q. Under the Gaussian
policy pi(a | o) = N(mu(o), sigma^2) that is

    p_q = P(a_0 > t_q) = Phi((mu_0(t_q) - t_q) / sigma_0),

so p and grad log p are exact (`success_log_prob`) and the simulation setting's estimator can
be checked against kappa(p, n) grad log p (docs/method.md#the-estimator-and-its-scale) by
Monte Carlo, as the classification setting is against its closed form.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy.special import log_ndtr

from sera_jax.settings.sim.env import Environment

ACTION_SIZE = 2  # the second component plays no part in success: a nuisance the score carries


class OneStepState(NamedTuple):
  obs: jax.Array  # [1]: the threshold
  action: jax.Array  # [ACTION_SIZE]


def reset(key: jax.Array) -> OneStepState:
  threshold = jax.random.uniform(key, (1,), minval=-2.5, maxval=2.5)
  return OneStepState(threshold, jnp.zeros(ACTION_SIZE))


def step(state: OneStepState, action: jax.Array) -> OneStepState:
  return state._replace(action=action)


def succeeded(state: OneStepState) -> jax.Array:
  return state.action[0] > state.obs[0]


def success_log_prob(policy, params, scenario_keys: jax.Array) -> jax.Array:
  """Exact log p [Q] of the scenarios of `scenario_keys` under `policy` (a `GaussianPolicy`)
  with `params`."""
  thresholds = jax.vmap(reset)(scenario_keys).obs
  mean, log_std = policy.distribution(params, thresholds)
  return log_ndtr((mean[:, 0] - thresholds[:, 0]) * jnp.exp(-log_std[0]))


def environment() -> Environment:
  return Environment(reset=reset, step=step, success=succeeded, horizon=1,
                     action_size=ACTION_SIZE)
