"""Where an RL step of the MJX navigation task (`--config sim_nav`) spends its time.

Each part is timed by itself in one process, against the whole SERA step
(`SimTask.rl_step_fn`, jitted) on the same batch:

* simulation: the B = M N0 episodes of the step in MJX (reset and `horizon` steps each,
  vmapped), their actions given, so no policy;
* policy: the Gaussian MLP at every observation of the B episodes and the gradient of their
  log-probabilities (the step's forward passes while sampling and its backward pass);
* allocation: SERA's counts on the historical estimate (`historical_allocation`);
* episodes: simulation and sampling together (`SimTask.episodes`).

It prints each part's time, its share of the step, and the simulator's env-steps per second.

  python benchmarks/sim.py [--repeats 5]
"""

import argparse
import time

import jax
import jax.numpy as jnp

from sera_jax.harness import configs
from sera_jax.method.historical import historical_allocation
from sera_jax.settings.sim import env as sim_env
from sera_jax.settings.sim import task as sim_task


def _seconds(fn, repeats: int) -> float:
  """The best of `repeats` calls of `fn`, each finished (after one call that compiles)."""
  jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - start)
  return best


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  config = configs.load("sim_nav")
  task = sim_task.SimTask(config)
  environment = task.environment
  state = task.init_state(jax.random.PRNGKey(0))
  ids, _ = sim_task.batch_ids(config, 0)
  ids = jnp.asarray(ids)
  budget = config.batch_size * config.baseline_n
  scenarios = jnp.repeat(ids, config.baseline_n)
  key = jax.random.PRNGKey(1)
  observations, actions, _ = jax.jit(task.episodes)(state.params, scenarios, key)

  def simulate(scenario_ids, actions):
    def episode(scenario, episode_actions):
      start = environment.reset(sim_env.scenario_key(config.data_seed, scenario))
      final, _ = jax.lax.scan(lambda s, a: (environment.step(s, a), None), start,
                              episode_actions)
      return environment.success(final)
    return jax.vmap(episode)(scenario_ids, actions)

  def policy(params):
    return jax.grad(lambda p: jnp.sum(task.policy.log_prob_episodes(p, observations,
                                                                    actions)))(params)

  parts = {
      "step (SERA)": jax.jit(task.rl_step_fn),
      "simulation": jax.jit(simulate),
      "policy": jax.jit(policy),
      "allocation": jax.jit(lambda h, i: historical_allocation(task.allocation, h, i, False,
                                                                True)),
      "episodes": jax.jit(task.episodes),
  }
  inputs = {
      "step (SERA)": (state, ids, 0, False),
      "simulation": (scenarios, actions),
      "policy": (state.params,),
      "allocation": (state.historical, ids),
      "episodes": (state.params, scenarios, key),
  }
  times = {name: _seconds(lambda f=fn, a=inputs[name]: f(*a), args.repeats)
           for name, fn in parts.items()}
  step = times["step (SERA)"]
  print(f"sim_nav: B = {budget} episodes of {environment.horizon} steps, "
        f"{jax.devices()[0].platform}")
  for name, seconds in times.items():
    print(f"  {name:12s} {seconds * 1e3:9.1f} ms  {seconds / step:6.1%} of the step")
  print(f"  simulation: {budget * environment.horizon / times['simulation']:,.0f} env-steps/s")


if __name__ == "__main__":
  main()
