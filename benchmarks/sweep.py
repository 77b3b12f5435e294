"""R runs as one vmapped program against the same R runs one after another.

For each model, R runs that differ in their seed are trained twice in this one process:
one after another (`ClassificationTask`, `MazeTask`: each run its own jitted step), and
as one batch (`BatchedClassification`, `BatchedMaze`: one jitted step vmapped over the
runs). The digits MLP and the small CNN are the default classification config's models
(--steps steps); "maze" is the maze config's policy in its RL steps (warmup_steps = 0, so
one program; --maze-steps steps); "n0_1024" is budget scaling's SERA run at N0 = 1024
(synthetic1000, 128 prompts of up to 4096 rollouts, aligned at step 0 only, so two
programs; --maze-steps steps). The first step of each program is timed apart as its
compile (the sequential runs compile R times: each run's rates are its own constants).
The table gives the seconds a run of the other steps, and the ratio sequential / batched
of the whole R runs, with and without compiling.

  python benchmarks/sweep.py [--models mlp small_cnn maze n0_1024] [--runs 10]
                             [--steps 200] [--maze-steps 20]
"""

import argparse
import time

import jax

from sera_jax.harness import configs
from sera_jax.harness.figures import scaling
from sera_jax.settings.classification.batched import BatchedClassification
from sera_jax.settings.classification.task import ClassificationTask
from sera_jax.settings.maze.batched import BatchedMaze
from sera_jax.settings.maze.task import MazeTask

# (the task of a run alone, the batch of R runs) of each setting.
SETTINGS = {"classification": (ClassificationTask, BatchedClassification),
            "maze": (MazeTask, BatchedMaze)}


def _config(model: str, seed: int, steps: int):
  if model == "n0_1024":
    return scaling.run_config("sera", 1024, seed, steps, steps, learning_rate=0.05)
  if model == "maze":
    config = configs.load("maze")
    config.update(seed=seed, num_steps=steps, warmup_steps=0)
  else:
    config = configs.load("default")
    config.update(model=model, seed=seed, num_steps=steps)
  return config


def _timed(train_step, state, steps: int, programs: int) -> tuple[float, float]:
  """(seconds of the first `programs` steps, each compiling one of the run's programs;
  seconds of the other steps)."""
  start = time.perf_counter()
  for step in range(programs):
    state, metrics = train_step(state, step)
  jax.block_until_ready((state, metrics))
  first = time.perf_counter() - start
  start = time.perf_counter()
  for step in range(programs, steps):
    state, metrics = train_step(state, step)
  jax.block_until_ready((state, metrics))
  return first, time.perf_counter() - start


def measure(model: str, runs: int, steps: int) -> dict[str, float]:
  """Seconds: first steps and later steps of the R runs, one after another and batched."""
  configs_ = [_config(model, seed, steps) for seed in range(runs)]
  sequential_first = sequential_rest = 0.0
  single, batch_of = SETTINGS[configs_[0].task]
  # A classification run that aligns only every k > 1 steps compiles a second program (the
  # steps without alignment) at step 1.
  programs = 1 if configs_[0].get("align_every", 1) == 1 else 2
  for config in configs_:
    task = single(config)
    first, rest = _timed(task.train_step, task.init_state(jax.random.PRNGKey(config.seed)),
                         steps, programs)
    sequential_first += first
    sequential_rest += rest
  batch = batch_of(configs_)
  batched_first, batched_rest = _timed(batch.train_step, batch.init_state(), steps, programs)
  return {"sequential_first": sequential_first, "sequential_rest": sequential_rest,
          "batched_first": batched_first, "batched_rest": batched_rest}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=["mlp", "small_cnn", "maze"])
  parser.add_argument("--runs", type=int, default=10)
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--maze-steps", type=int, default=20)
  args = parser.parse_args(argv)
  print(f"{jax.devices()[0].platform}, R = {args.runs} runs, {args.steps} steps a run "
        f"({args.maze_steps} for the maze)")
  print(f"{'model':<10} {'s/run seq':>10} {'s/run batch':>12} {'ratio':>7} "
        f"{'compile seq':>12} {'compile batch':>14} {'ratio w/ compile':>17}")
  for model in args.models:
    steps = args.maze_steps if model in ("maze", "n0_1024") else args.steps
    t = measure(model, args.runs, steps)
    total_seq = t["sequential_first"] + t["sequential_rest"]
    total_batch = t["batched_first"] + t["batched_rest"]
    print(f"{model:<10} {t['sequential_rest'] / args.runs:>10.3f} "
          f"{t['batched_rest'] / args.runs:>12.3f} "
          f"{t['sequential_rest'] / t['batched_rest']:>7.2f} "
          f"{t['sequential_first']:>12.2f} {t['batched_first']:>14.2f} "
          f"{total_seq / total_batch:>17.2f}", flush=True)


if __name__ == "__main__":
  main()
