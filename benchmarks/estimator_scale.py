"""`expected_scale` of a user's function against the registered name of the same formula.

Estimators are values (`sera_jax.estimator_spec`): a function a(reward, group_size, successes)
runs where a registered name does. This times both on one input, side by side in one process,
after each has compiled once, and prints the ratio (a user's function against the built-in
"maxrl", centered MaxRL written out by hand) and that both give the same numbers.

  python benchmarks/estimator_scale.py                   # M = 4096 prompts, n <= 64
  python benchmarks/estimator_scale.py --prompts 65536 --max-n 512
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import sera_jax


def centered_maxrl(reward, group_size, successes, *, eps):
  """The registered "maxrl" written as a user would: (r - mu) / (mu + eps), 0 when K = 0."""
  mean = jnp.where(group_size > 0, successes / jnp.maximum(group_size, 1), 0)
  return jnp.where(successes > 0, (reward - mean) / (mean + eps), 0)


def _best_seconds(calls: dict, repeats: int) -> dict[str, float]:
  """Best seconds of each call, the calls taking turns so that a busy machine slows both."""
  for call in calls.values():
    call().block_until_ready()  # compiles
  best = dict.fromkeys(calls, float("inf"))
  for _ in range(repeats):
    for name, call in calls.items():
      start = time.perf_counter()
      call().block_until_ready()
      best[name] = min(best[name], time.perf_counter() - start)
  return best


def measure(prompts: int = 4096, max_n: int = 64, repeats: int = 20,
            seed: int = 0) -> dict[str, float]:
  """Best seconds of expected_scale for the name and the function, their ratio, the largest
  difference of their results (relative)."""
  rng = np.random.default_rng(seed)
  log_p = jnp.asarray(np.log(rng.uniform(1e-3, 1.0, prompts)), jnp.float32)
  n = jnp.asarray(rng.integers(2, max_n + 1, prompts))
  calls = {name: functools.partial(jax.jit(functools.partial(
      sera_jax.expected_scale, estimator, max_n=max_n)), log_p, n)
      for name, estimator in (("name", "maxrl"), ("function", centered_maxrl))}
  seconds = _best_seconds(calls, repeats)
  by_name, by_function = (np.asarray(call()) for call in calls.values())
  difference = float(np.max(np.abs(by_function - by_name) / np.maximum(np.abs(by_name), 1e-30)))
  return {"name_s": seconds["name"], "function_s": seconds["function"],
          "ratio": seconds["function"] / seconds["name"], "max_relative_difference": difference}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--prompts", type=int, default=4096, help="M, the prompts (default 4096)")
  parser.add_argument("--max-n", type=int, default=64, help="the largest n (default 64)")
  parser.add_argument("--repeats", type=int, default=20, help="timed runs; the best counts")
  args = parser.parse_args()
  result = measure(args.prompts, args.max_n, args.repeats)
  print(f"expected_scale on {jax.devices()[0].platform}, M = {args.prompts}, n <= {args.max_n}")
  for label, key in (('the registered name "maxrl"', "name_s"),
                     ("the same formula as a user function", "function_s")):
    print(f"  {label + ':':<37} {1e3 * result[key]:9.3f} ms")
  print(f"  ratio function / name: {result['ratio']:.2f}x; largest relative difference of "
        f"the results {result['max_relative_difference']:.1e}")


if __name__ == "__main__":
  main()
