"""The environment a simulation setting trains in: the reset / step interface of JAX simulators.

An environment is anything with `reset(key) -> state` and `step(state, action) -> state`
whose state carries its observation as `state.obs`: MuJoCo Playground's `MjxEnv`, Brax's
`Env` and environments written to their API all have it. `Environment` wraps one with what
SERA needs besides (docs/method.md#simulated-scenarios):

* a **scenario** is a prompt: its id keys the reset (`scenario_key`), so a scenario can be
  run n times, each episode differing only in the policy's actions (and whatever noise the
  environment draws from its state);
* an **episode** of `horizon` steps is a rollout;
* **success** is the reward: a predicate on the final state (e.g. within r of the goal)
  that returns a boolean.

`from_suite` adapts an environment object of that API; `check` rejects one that does not
fit, each with a one-line error, before anything is compiled.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from sera_jax.method import validation

State = Any


@dataclasses.dataclass(frozen=True, eq=False)
class Environment:
  """A JAX environment as a setting of scenarios.

  Attributes:
    reset: reset(key) -> state, deterministic in `key` (the scenario's, `scenario_key`).
    step: step(state, action [action_size]) -> state.
    success: success(state) -> scalar bool, of the state after the last step.
    horizon: steps an episode takes (static).
    action_size: the length of an action vector.
    observe: observe(state) -> float [observation_size] (default: `state.obs`).
  """

  reset: Callable[[jax.Array], State]
  step: Callable[[State, jax.Array], State]
  success: Callable[[State], jax.Array]
  horizon: int
  action_size: int
  observe: Callable[[State], jax.Array] = lambda state: state.obs

  def observation_shape(self) -> tuple[int, ...]:
    return jax.eval_shape(lambda key: self.observe(self.reset(key)),
                          jax.random.PRNGKey(0)).shape


def from_suite(env: Any, *, success: Callable[[State], jax.Array], horizon: int) -> Environment:
  """An `Environment` of an environment object with MuJoCo Playground's / Brax's API:
  `env.reset(key)`, `env.step(state, action)`, `env.action_size` and the observation as
  `state.obs` (an array; Playground's dict observations name one entry with `observe`).

  Raises:
    TypeError: `env` lacks reset, step or action_size.
  """
  missing = [name for name in ("reset", "step", "action_size") if not hasattr(env, name)]
  if missing:
    raise TypeError(f"the environment {type(env).__name__} has no {', '.join(missing)}: a "
                    f"simulation setting needs reset(key), step(state, action) and "
                    f"action_size (MuJoCo Playground's and Brax's API).")
  return Environment(reset=env.reset, step=env.step, success=success, horizon=horizon,
                     action_size=int(env.action_size))


def scenario_key(scenario_seed: int, scenario_id) -> jax.Array:
  """The reset key of scenario `scenario_id` of the scenario generator `scenario_seed`."""
  return jax.random.fold_in(jax.random.PRNGKey(scenario_seed), scenario_id)


def check(environment: Environment) -> tuple[int, ...]:
  """Traces one reset, step and success of `environment` (nothing runs); returns the
  observation's shape.

  Raises:
    TypeError: the environment does not have the interface, its observation is not a
      float vector, or its success is not a scalar boolean.
    ValueError: a horizon that is not a positive integer, or an action size below 1.
  """
  if not isinstance(environment, Environment):
    raise TypeError(f"expected a sera_jax.settings.sim.env.Environment (from_suite wraps an "
                    f"environment object); got {type(environment).__name__}.")
  validation.integer("the environment's horizon", environment.horizon, minimum=1)
  validation.integer("the environment's action_size", environment.action_size, minimum=1)
  key = jax.random.PRNGKey(0)
  action = jnp.zeros((environment.action_size,), jnp.float32)
  try:
    state = jax.eval_shape(environment.reset, key)
    observation = jax.eval_shape(environment.observe, state)
    after = jax.eval_shape(environment.step, state, action)
    done = jax.eval_shape(environment.success, after)
  except (AttributeError, TypeError) as error:
    raise TypeError(f"the environment does not fit reset(key) -> state, step(state, action) "
                    f"-> state with the observation as state.obs: {error}") from None
  if (not hasattr(observation, "shape") or len(observation.shape) != 1
      or not jnp.issubdtype(observation.dtype, jnp.floating)):
    raise TypeError(f"the observation must be a float vector; got "
                    f"{getattr(observation, 'dtype', type(observation))}"
                    f"{list(getattr(observation, 'shape', []))}.")
  if not hasattr(done, "shape") or done.shape != () or done.dtype != jnp.bool_:
    raise TypeError(f"the success predicate must return a scalar bool; got "
                    f"{getattr(done, 'dtype', type(done))}{list(getattr(done, 'shape', []))}.")
  return tuple(observation.shape)
