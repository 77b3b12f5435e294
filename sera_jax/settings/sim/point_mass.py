"""Point-mass navigation in MuJoCo MJX: reach a goal through the gap of a wall.

A sphere slides in the plane of a 2 x 2 arena (two slide joints, one motor each, controls
clipped to [-1, 1], viscous damping) split by a wall at x = 0 with one gap. A scenario,
drawn from its key, is a start, a goal and the gap's height; the wall moves with the gap
through the model's geom positions, which MJX batches like any array (`mjx.Model.replace`),
so every episode of a vmapped batch has its own layout in one program. What a batched model
field cannot change is the model's structure: the number of bodies, geoms and joints is
fixed, so a layout is a placement of the same walls (a wall can be moved out of the arena,
not removed).

Observation: position, velocity, goal - position and the gap's height (7 floats). Success:
the sphere within `GOAL_RADIUS` of the goal after the last step. Scenarios on one side of
the wall are easy for a policy that heads for the goal, those across it need the gap, and
far goals need speed: p spreads over orders of magnitude.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import mujoco
from mujoco import mjx

from sera_jax.settings.sim.env import Environment

ARENA = 1.0  # half-side of the arena
GAP = 0.35  # the gap's width
GOAL_RADIUS = 0.15
HORIZON = 40  # steps of 0.05 s
_SEGMENT = 2.0  # half-length of each wall segment: it spans the arena from either side

# Under vmap MJX's constraint solver runs until every episode of the batch has converged, up
# to its iteration limits (100 and 50 by default). A sphere against boxes converges well
# within 4: the cap leaves the trajectories as they were (tests/test_sim.py) and makes an RL
# step about 7x faster on the CPU (benchmarks/sim.py).
XML = f"""
<mujoco model="point_mass_gap">
  <option timestep="0.05" gravity="0 0 0" iterations="4" ls_iterations="4"/>
  <worldbody>
    <geom name="east" type="box" size="0.05 {ARENA + 0.1} 0.1" pos="{ARENA + 0.05} 0 0"/>
    <geom name="west" type="box" size="0.05 {ARENA + 0.1} 0.1" pos="{-ARENA - 0.05} 0 0"/>
    <geom name="north" type="box" size="{ARENA + 0.1} 0.05 0.1" pos="0 {ARENA + 0.05} 0"/>
    <geom name="south" type="box" size="{ARENA + 0.1} 0.05 0.1" pos="0 {-ARENA - 0.05} 0"/>
    <geom name="upper" type="box" size="0.05 {_SEGMENT} 0.1" pos="0 {GAP / 2 + _SEGMENT} 0"/>
    <geom name="lower" type="box" size="0.05 {_SEGMENT} 0.1" pos="0 {-GAP / 2 - _SEGMENT} 0"/>
    <body name="mass">
      <joint name="x" type="slide" axis="1 0 0" damping="1"/>
      <joint name="y" type="slide" axis="0 1 0" damping="1"/>
      <geom name="ball" type="sphere" size="0.05" mass="1" contype="1" conaffinity="1"/>
    </body>
  </worldbody>
  <actuator>
    <motor joint="x" gear="2" ctrllimited="true" ctrlrange="-1 1"/>
    <motor joint="y" gear="2" ctrllimited="true" ctrlrange="-1 1"/>
  </actuator>
</mujoco>
"""
_UPPER, _LOWER = 4, 5  # the wall segments' geom ids


class PointMassState(NamedTuple):
  data: mjx.Data
  goal: jax.Array  # [2]
  gap: jax.Array  # the gap's centre height
  geom_pos: jax.Array  # [ngeom, 3]: this scenario's layout
  obs: jax.Array  # [7]


def scenario(key: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(start [2], goal [2], gap height) of the scenario keyed `key`: start and goal uniform
  in the arena away from its walls and the middle wall, the gap uniform in [-0.6, 0.6]."""
  side, start, goal, gap = jax.random.split(key, 4)
  lows, highs = jnp.array([0.15, -0.85]), jnp.array([0.85, 0.85])
  point = lambda k, sign: jax.random.uniform(k, (2,), minval=lows, maxval=highs) * jnp.array(  # noqa: E731
      [sign, 1.0])
  signs = jnp.where(jax.random.bernoulli(side, 0.5, (2,)), 1.0, -1.0)
  return point(start, signs[0]), point(goal, signs[1]), jax.random.uniform(gap, (), minval=-0.6,
                                                                            maxval=0.6)


class PointMass:
  """The navigation task with MuJoCo Playground's API: reset(key), step(state, action),
  action_size, and the observation as state.obs."""

  action_size = 2

  def __init__(self):
    self.mj_model = mujoco.MjModel.from_xml_string(XML)
    self.model = mjx.put_model(self.mj_model)

  def _observe(self, data: mjx.Data, goal: jax.Array, gap: jax.Array) -> jax.Array:
    return jnp.concatenate([data.qpos, data.qvel, goal - data.qpos, gap[None]])

  def reset(self, key: jax.Array) -> PointMassState:
    start, goal, gap = scenario(key)
    geom_pos = self.model.geom_pos.at[_UPPER, 1].add(gap).at[_LOWER, 1].add(gap)
    data = mjx.make_data(self.model).replace(qpos=start)
    data = mjx.forward(self.model.replace(geom_pos=geom_pos), data)
    return PointMassState(data, goal, gap, geom_pos, self._observe(data, goal, gap))

  def step(self, state: PointMassState, action: jax.Array) -> PointMassState:
    model = self.model.replace(geom_pos=state.geom_pos)
    data = mjx.step(model, state.data.replace(ctrl=action))
    return state._replace(data=data, obs=self._observe(data, state.goal, state.gap))


def reached(state: PointMassState) -> jax.Array:
  """Success: the sphere within GOAL_RADIUS of the goal."""
  return jnp.linalg.norm(state.data.qpos - state.goal) < GOAL_RADIUS


def environment(horizon: int = HORIZON) -> Environment:
  """The task as a setting's `Environment`."""
  env = PointMass()
  return Environment(reset=env.reset, step=env.step, success=reached, horizon=horizon,
                     action_size=env.action_size)
