"""A Gaussian policy on observations, and the episode's log-probability as its sequence score.

pi(a | o) = N(a; mu_theta(o), diag(sigma^2)), mu an MLP (`sera_jax.common.models.mlp.MLP`),
log sigma a learned vector independent of o. An episode of T steps is a rollout whose score
is the log-probability of its actions, log pi(tau) = sum_t log pi(a_t | o_t): the transition
probabilities of the simulator do not depend on theta, so grad log pi(tau) is the score of
the whole episode that the estimator's E[g] = kappa(p, n) grad log p needs
(docs/method.md#the-score-of-a-sequence). The gradient never passes through the simulator.
"""

import dataclasses
import functools
import math

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from sera_jax.common.models.mlp import MLP
from sera_jax.method import validation
from sera_jax.settings.sim.env import Environment

LOG_2PI = math.log(2 * math.pi)


class GaussianMLP(nnx.Module):
  """mu_theta(o) and log sigma."""

  def __init__(self, observation_size: int, action_size: int, hidden_sizes, init_log_std: float,
               *, rngs: nnx.Rngs):
    self.mean = MLP((observation_size,), action_size, hidden_sizes=hidden_sizes, rngs=rngs)
    self.log_std = nnx.Param(jnp.full((action_size,), init_log_std, jnp.float32))

  def __call__(self, observations: jax.Array) -> tuple[jax.Array, jax.Array]:
    return self.mean(observations, train=False), self.log_std[...]


def gaussian_log_prob(actions: jax.Array, mean: jax.Array, log_std: jax.Array) -> jax.Array:
  """log N(actions; mean, diag(exp(log_std)^2)), summed over the last axis."""
  z = (actions - mean) * jnp.exp(-log_std)
  return jnp.sum(-0.5 * z**2 - log_std - 0.5 * LOG_2PI, axis=-1)


@dataclasses.dataclass(frozen=True)
class GaussianPolicy:
  """The policy's pure functions over a pure-dict of parameters."""

  observation_size: int
  action_size: int
  hidden_sizes: tuple[int, ...] = (64, 64)
  init_log_std: float = 0.0

  def __post_init__(self):
    validation.integer("observation_size", self.observation_size, minimum=1)
    validation.integer("action_size", self.action_size, minimum=1)
    for width in self.hidden_sizes:
      validation.integer("hidden_sizes", width, minimum=1)
    validation.real("init_log_std", self.init_log_std)

  def _network(self, key: jax.Array) -> GaussianMLP:
    return GaussianMLP(self.observation_size, self.action_size, self.hidden_sizes,
                       self.init_log_std, rngs=nnx.Rngs(params=key))

  @functools.cached_property
  def _graphdef(self):
    return nnx.split(nnx.eval_shape(lambda: self._network(jax.random.key(0))))[0]

  @functools.partial(jax.jit, static_argnums=0)
  def init(self, key: jax.Array) -> dict:
    """Fresh parameters as a pure dict."""
    return nnx.to_pure_dict(nnx.state(self._network(key)))

  def distribution(self, params: dict, observations: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(mean [..., action_size], log_std [action_size]) at `observations` [..., obs]."""
    chex.assert_axis_dimension(observations, -1, self.observation_size)
    flat = observations.reshape(-1, self.observation_size)
    mean, log_std = nnx.merge(self._graphdef, params)(flat)
    return mean.reshape(*observations.shape[:-1], self.action_size), log_std

  def log_prob_episodes(self, params: dict, observations: jax.Array, actions: jax.Array
                        ) -> jax.Array:
    """log pi(tau) [E] of E episodes' observations [E, T, obs] and actions [E, T, act]."""
    chex.assert_rank([observations, actions], 3)
    mean, log_std = self.distribution(params, observations)
    return jnp.sum(gaussian_log_prob(actions, mean, log_std), axis=-1)

  def run_episode(self, params: dict, environment: Environment, reset_key: jax.Array,
                  action_key: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One episode from reset(reset_key), actions drawn from `action_key`.

    Returns:
      (observations [T, obs] each action was drawn at, actions [T, act], success: bool).
    """
    def step(state, key):
      observation = environment.observe(state)
      mean, log_std = self.distribution(params, observation)
      action = mean + jnp.exp(log_std) * jax.random.normal(key, mean.shape, mean.dtype)
      return environment.step(state, action), (observation, action)

    keys = jax.random.split(action_key, environment.horizon)
    final, (observations, actions) = jax.lax.scan(step, environment.reset(reset_key), keys)
    return observations, actions, environment.success(final)
