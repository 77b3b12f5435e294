"""R runs as one vmapped program against the same R runs one after another.

For each model, R runs that differ in their seed are trained both ways in this one process:
one after another (`ClassificationTask`, `MazeTask`: each run its own jitted step), and
as one batch (`BatchedClassification`, `BatchedMaze`: one jitted step vmapped over the
runs, or on the CPU looped over them inside the program: the maze's steps, and the sampling
of a classification batch with many rollouts). The digits MLP and the small CNN are the
default classification config's models (--steps steps a round); "maze" is the maze config's
policy in its RL steps (warmup_steps = 0, so one program; --maze-steps steps a round);
"n0_1024" is budget scaling's SERA run at N0 = 1024 (synthetic1000, 128 prompts of up to
4096 rollouts, aligned at step 0 only, so two programs; --maze-steps steps a round), and
"n0_16" and "n0_128" its runs at those N0 (--steps steps a round). The first step of
each program is timed apart as its compile (the sequential runs compile R times: each
run's rates are its own constants). Then --repeats rounds each train the R runs one after
another and the batch for the same steps, back to back, so that a change in the machine's
speed falls on both ways alike. The table gives the median over the rounds of the seconds a
run, the median and the range of the rounds' ratios sequential / batched, and the ratio
with compiling (compile plus one median round).

  python benchmarks/sweep.py [--models mlp small_cnn maze n0_1024] [--runs 10]
                             [--steps 200] [--maze-steps 20] [--repeats 5]
"""

import argparse
import statistics
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
  if model.startswith("n0_"):  # budget scaling's SERA run at N0 = 16, 128 or 1024
    return scaling.run_config("sera", int(model.removeprefix("n0_")), seed, steps, steps,
                              learning_rate=0.05)
  if model == "maze":
    config = configs.load("maze")
    config.update(seed=seed, num_steps=steps)
  else:
    config = configs.load("default")
    config.update(model=model, seed=seed, num_steps=steps)
  return config


def _train(train_step, state, steps: range):
  """(state after `steps`, seconds they took, finished)."""
  start = time.perf_counter()
  for step in steps:
    state, metrics = train_step(state, step)
  jax.block_until_ready((state, metrics))
  return state, time.perf_counter() - start


def measure(model: str, runs: int, steps: int, repeats: int) -> dict[str, object]:
  """Seconds: the first steps (compiling) of the R runs one after another and batched, and
  the `repeats` rounds of `steps` steps after them, each way ("sequential_rounds",
  "batched_rounds": lists)."""
  # A classification run that aligns only every k > 1 steps compiles a second program (the
  # steps without alignment) at step 1.
  programs = 1 if _config(model, 0, steps).get("align_every", 1) == 1 else 2
  total = programs + repeats * steps  # every run's num_steps: its schedule covers them all
  configs_ = [_config(model, seed, total) for seed in range(runs)]
  single, batch_of = SETTINGS[configs_[0].task]
  tasks = [single(config) for config in configs_]
  states, sequential_first = [], 0.0
  for task, config in zip(tasks, configs_, strict=True):
    state, seconds = _train(task.train_step, task.init_state(jax.random.PRNGKey(config.seed)),
                            range(programs))
    states.append(state)
    sequential_first += seconds
  batch = batch_of(configs_)
  batched_state, batched_first = _train(batch.train_step, batch.init_state(), range(programs))
  sequential_rounds, batched_rounds = [], []
  for round_ in range(repeats):
    steps_of_round = range(programs + round_ * steps, programs + (round_ + 1) * steps)
    sequential_rounds.append(0.0)
    for index, task in enumerate(tasks):
      states[index], seconds = _train(task.train_step, states[index], steps_of_round)
      sequential_rounds[-1] += seconds
    batched_state, seconds = _train(batch.train_step, batched_state, steps_of_round)
    batched_rounds.append(seconds)
  return {"sequential_first": sequential_first, "batched_first": batched_first,
          "sequential_rounds": sequential_rounds, "batched_rounds": batched_rounds}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=["mlp", "small_cnn", "maze"])
  parser.add_argument("--runs", type=int, default=10)
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--maze-steps", type=int, default=20)
  parser.add_argument("--repeats", type=int, default=5, help="rounds of both ways")
  args = parser.parse_args(argv)
  print(f"{jax.devices()[0].platform}, R = {args.runs} runs, {args.repeats} rounds of "
        f"{args.steps} steps a run ({args.maze_steps} for the maze and n0_1024)")
  print(f"{'model':<10} {'s/run seq':>10} {'s/run batch':>12} {'ratio':>7} {'range':>11} "
        f"{'compile seq':>12} {'compile batch':>14} {'ratio w/ compile':>17}")
  for model in args.models:
    steps = args.maze_steps if model in ("maze", "n0_1024") else args.steps
    t = measure(model, args.runs, steps, args.repeats)
    ratios = [s / b for s, b in zip(t["sequential_rounds"], t["batched_rounds"], strict=True)]
    sequential = statistics.median(t["sequential_rounds"])
    batched = statistics.median(t["batched_rounds"])
    with_compile = (t["sequential_first"] + sequential) / (t["batched_first"] + batched)
    print(f"{model:<10} {sequential / args.runs:>10.3f} {batched / args.runs:>12.3f} "
          f"{statistics.median(ratios):>7.2f} {min(ratios):>5.2f}-{max(ratios):<5.2f} "
          f"{t['sequential_first']:>12.2f} {t['batched_first']:>14.2f} "
          f"{with_compile:>17.2f}", flush=True)


if __name__ == "__main__":
  main()
