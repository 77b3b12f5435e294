"""Pass@k of SERA, uniform MaxRL and GRPO on held-out mazes, at the paper's protocol.

One warm start, made once and shared by every method and seed: imitation of the BFS paths of
a pool of mazes that shares no maze and no shortest path with the RL, validation and held-out
sets, each pool maze seen once (`sera_jax.settings.maze.warm_start`). Every run then trains
from it with the same rollout budget B = M * N0 a step on a fixed RL set of mazes, revisited
for many epochs. pass@k (k = 1, 2, 4, ..., unbiased, from config.eval_samples samples a maze)
is measured on fresh i.i.d. held-out mazes, unfiltered; the held-out mazes whose shortest path
no RL maze has make a secondary table, and `maze-blind`, a policy replaying the RL set's
solutions whatever the maze, is the memorisation baseline (exact) beside both. Before RL the
figure reports the warm start's pass@k and the spread of its success probability p over the
RL set (SERA allocates over that spread), and the overlaps between the sets, counted.

Each method's RL learning rate is chosen from --learning-rates by its mean validation
pass@16 (fresh i.i.d. validation mazes) over --tuning-seeds tuning seeds (100, 101, ...),
which train at every rate and are never reported; the reported seeds train at the chosen
rate only. The held-out mazes play no part in the choice: tuning runs score the validation
mazes only, reported runs the held-out ones only.

  sera-jax figure maze            # the CPU config, 3 methods x 5 rates x 2 tuning seeds, 10 seeds
  sera-jax figure maze --tiny     # a smoke run (a few minutes)

Writes into --out (default docs/figures/maze): maze_passk.png and maze_passk.csv (held-out
pass@k of every seed at the chosen rates, and the paired differences to uniform),
maze_passk_unseen_path.csv (the same on the held-out mazes with unseen paths),
maze_passk_rates.png and maze_passk_rates.csv (the whole grid's validation pass@k) and
maze_passk.manifest.json (the command, commit, versions, wall time and the protocol's counts); one
training workdir per run under --workdir and the warm start in its warm_start/ (a run, or
the warm start, of the same config is resumed or read back; one of another config stops the
figure). Each method's tuning grid trains as one program, its reported seeds as another
(`sera-jax sweep`'s batches), and a run that goes non-finite scores NaN (never chosen).
--tiny names its files maze_passk_tiny* and trains under runs/maze_passk_tiny.
"""

import os
import sys

import jax
import numpy as np

from sera_jax.common import files
from sera_jax.harness import configs
from sera_jax.harness.figures import common
from sera_jax.settings.maze import env as maze_env
from sera_jax.settings.maze import warm_start
from sera_jax.settings.maze.sets import replay_pass_at_k
from sera_jax.settings.maze.task import MazeTask

NAME = "maze_passk"
CPU_COST = "about 4 h"  # on a 2-core CPU (`sera-jax figure --list`)
OUT_DIR = os.path.join(common.OUT_DIR, "maze")
RATES_SUFFIX = "_rates"
UNSEEN_SUFFIX = "_unseen_path"
WARM_START = "warm start"
MAZE_BLIND = "maze-blind"  # replays the RL set's solutions, whatever the maze
REFERENCES = (WARM_START, MAZE_BLIND)  # not RL methods: no paired difference to uniform
LEARNING_RATES = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3)
CHOSEN_BY = 16  # the rate of the best validation pass@16
RL_SET_SAMPLES = 128  # samples of each RL maze that measure the warm start's p


def load_config(tiny: bool, maze_size: int | None = None):
  config = configs.load("maze")
  if tiny:  # a smoke run of the pipeline: small mazes, a small policy, few steps
    config.update(dict(maze_size=9, dim=32, num_layers=1, num_heads=2, num_train_mazes=32,
                       batch_size=8, num_eval_mazes=16, num_validation_mazes=16,
                       eval_batch_size=8, eval_samples=64, num_sft_mazes=256,
                       sft_disjoint_paths=False, num_steps=12, checkpoint_every=6))
  if maze_size is not None:
    config.maze_size = maze_size
  config.eval_every = config.num_steps  # one evaluation, at the end
  return config


def pre_rl_checks(task: MazeTask) -> dict:
  """The warm start's pass@k on every evaluation set and its success rates on the RL set."""
  params = task.warm_start()
  state = task.init_state(jax.random.PRNGKey(0))
  scores = task.evaluate(state)
  p = task.rl_set_success_rates(params, RL_SET_SAMPLES)
  levels = [0, 0.1, 0.25, 0.5, 0.75, 0.9, 1]
  quantiles = dict(zip(("min", "q10", "q25", "median", "q75", "q90", "max"),
                       np.quantile(p, levels).round(4).tolist(), strict=True))
  return {"scores": scores, "params_digest": warm_start.params_digest(params),
          "rl_set_p": {"samples_per_maze": RL_SET_SAMPLES, **quantiles,
                       "fraction_0": round(float(np.mean(p == 0)), 4),
                       "fraction_1": round(float(np.mean(p == 1)), 4)}}


def protocol(config, task: MazeTask, checks: dict) -> dict:
  """The protocol facts of the manifest, counted from the sets and the runs."""
  sets = task.sets
  return {"maze_size": config.maze_size, "held_out_mazes": len(sets.held_out.mazes),
          "validation_mazes": len(sets.validation.mazes),
          "unseen_path_held_out_mazes": int(sets.unseen_path.sum()),
          "samples_per_maze": config.eval_samples, "shared_warm_start": True,
          "warm_start_digest": checks["params_digest"], "sft_mazes": len(sets.sft.mazes),
          "sft_candidates": sets.sft.candidates, "rl_mazes": len(sets.rl.mazes),
          "rl_steps": config.num_steps,
          "rl_epochs": config.num_steps * config.batch_size / config.num_train_mazes,
          "rollouts_per_step": config.batch_size * config.baseline_n,
          "overlaps": sets.overlaps(), "shared_paths": sets.shared_paths(),
          "warm_start_rl_set_p": checks["rl_set_p"]}


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  parser = common.figure_parser("maze", __doc__)
  parser.set_defaults(out=OUT_DIR)
  common.add_method_grid(parser, LEARNING_RATES)
  parser.add_argument("--maze-size", type=int, default=None,
                      help="odd side of the mazes (default the config's, 13); replay of the RL "
                      "set's solutions earns less on larger mazes (the figure's maze-blind row)")
  parser.add_argument("--workdir", default=None, help="default runs/maze_passk[_tiny]")
  args = parser.parse_args(argv)
  seeds, tuning_seeds = common.method_grid_seeds(parser, args)
  if args.maze_size is not None:
    try:
      maze_env.check_size(args.maze_size)
    except ValueError as error:
      parser.error(f"--maze-size: {error}")
  workdir = files.path(args.workdir or "runs/" + NAME + "_tiny" * args.tiny)
  config = load_config(args.tiny, args.maze_size)
  config.warm_start_dir = os.fspath(workdir / "warm_start")
  figure_run = common.start_figure()
  task = MazeTask(config)
  ks = task.ks
  checks = pre_rl_checks(task)
  facts = protocol(config, task, checks)
  print(f"before RL: warm start held-out pass@1 {checks['scores']['pass@1']:.3f}, "
        f"validation pass@1 {checks['scores']['validation/pass@1']:.3f}; its p over the "
        f"{facts['rl_mazes']} RL mazes: {facts['warm_start_rl_set_p']}; overlaps "
        f"{facts['overlaps']}; shared paths {facts['shared_paths']}", flush=True)
  blind = {"": replay_pass_at_k(task.train_paths, task.eval_mazes, ks),
           UNSEEN_SUFFIX: replay_pass_at_k(task.train_paths,
                                           task.eval_mazes[task.sets.unseen_path], ks)}
  tuned = common.tune_methods(config, args.methods, seeds, sorted(set(args.learning_rates)),
                             tuning_seeds, workdir, figure_run, chosen_by=CHOSEN_BY,
                             one_by_one=args.one_by_one)
  stem = NAME + "_tiny" * args.tiny
  rates = ", ".join(f"{method} {runs.rate:g}" for method, runs in tuned.items())
  for suffix, prefix in (("", ""), (UNSEEN_SUFFIX, "unseen_path/")):
    results = {WARM_START: dict.fromkeys(seeds, [checks["scores"][f"{prefix}pass@{k}"]
                                                 for k in ks]),
               MAZE_BLIND: dict.fromkeys(seeds, list(blind[suffix]))}
    results |= {method: {seed: [row.get(f"{prefix}pass@{k}", np.nan) for k in ks]
                         for seed, row in runs.runs.items()} for method, runs in tuned.items()}
    png, csv = common.output_paths(args.out, stem + suffix)
    common.write_pass_at_k_csv(results, seeds, ks, csv, exclude=REFERENCES)
    what = "held-out mazes" + " whose path no RL maze has" * bool(suffix)
    if not suffix:
      common.plot_pass_at_k(
          results, seeds, ks, png, what=what, exclude=REFERENCES,
          styles={WARM_START: dict(linestyle="--", color="gray"),
                  MAZE_BLIND: dict(linestyle=":", color="black")},
          title=f"{config.maze_size}x{config.maze_size} mazes, B = {config.batch_size} x "
          f"{config.baseline_n} rollouts/step, {config.num_steps} RL steps on "
          f"{facts['rl_mazes']} mazes, one warm start, {len(seeds)} seeds, Adam at {rates} "
          f"(chosen on validation); {facts['held_out_mazes']} i.i.d. held-out mazes")
    print(f"{what}:\n" + common.pass_at_k_tables(results, seeds, ks, exclude=REFERENCES))
    for method in tuned:
      if method != "uniform" and "uniform" in tuned:
        print(common.seeds_ahead(results, seeds, ks, method))
  rates_png, rates_csv = common.output_paths(args.out, stem + RATES_SUFFIX)
  common.write_validation_grid_csv(tuned, ks, rates_csv)
  common.plot_validation_grid(
      tuned, rates_png, ylabel=f"validation pass@{CHOSEN_BY} (mean of {args.tuning_seeds} seeds)",
      title="maze: each method's RL learning rate (star: chosen)")
  facts["learning_rates"] = common.rate_choices(tuned)
  manifest = common.write_manifest(
      args.out, stem, figure_run, command="figure maze", argv=argv, seeds=seeds,
      tuning_seeds=tuning_seeds, protocol=facts)
  print(f"total {figure_run.elapsed():.0f} s; wrote {common.output_paths(args.out, stem)}, "
        f"{rates_png}, {rates_csv} and {manifest}")
