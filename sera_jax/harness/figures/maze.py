"""Pass@k of SERA, uniform MaxRL and GRPO on held-out mazes, each at its own learning rate.

For each seed, every method starts from the same supervised warm start (same
seed, same steps) and then trains with the same rollout budget B = M * N0 per
step; pass@k (k = 1, 2, ..., 256, unbiased, from 256 samples a maze) is
measured on the held-out mazes after the warm start and at the end of RL. The
held-out mazes' shortest paths occur in no training maze, and `maze-blind`, a
policy replaying training solutions, is the memorisation baseline (exact).

Each method's RL learning rate is chosen from --learning-rates by its mean
pass@16 on validation mazes (their shortest paths occur in no training and no
held-out maze) over --tuning-seeds tuning seeds (100, 101, ...), which train at
every rate and are never reported (the run that wins the choice would report a
held-out score biased by its luck); the reported seeds train at the chosen rate
only. The held-out mazes play no part in the choice.

  sera-jax figure maze            # CPU config, 3 methods x 4 rates x 2 tuning seeds, 10 seeds
  sera-jax figure maze --tiny     # a smoke run (a few minutes)
  sera-jax figure maze --maze-size 13 --workdir runs/maze_passk_13 --out figures_13
                                  # 13x13 mazes: 196 distinct training solutions, not 40

Writes maze_passk.png and maze_passk.csv (mean, std, 95% interval and every
seed's value at the chosen rates, and the paired differences to uniform) and
maze_passk_rates.png and maze_passk_rates.csv (the whole grid: validation and
held-out pass@k of every tuning run) into --out, and one training workdir per
run under --workdir (metrics/, TensorBoard; a run of the same config is resumed
or read back, one of another config stops the figure). Each method's tuning
grid trains as one program, its reported seeds as another (`sera-jax sweep`'s
batches: their checkpoints in a batch-* directory beside the runs), and a run
that goes non-finite scores NaN (never chosen) while the others go on.
--tiny names its files maze_passk_tiny* and trains under runs/maze_passk_tiny.
"""

import os
import time

import jax

from sera_jax.common import files
from sera_jax.common.plots import plt, save_figure
from sera_jax.harness import configs
from sera_jax.harness.figures import common
from sera_jax.settings.maze import env as maze_env
from sera_jax.settings.maze.task import PASS_AT_K, MazeTask, replay_pass_at_k

NAME = "maze_passk"
RATES_SUFFIX = "_rates"
WARM_START = "warm start"
MAZE_BLIND = "maze-blind"  # replays training solutions, whatever the maze
LEARNING_RATES = (1e-4, 3e-4, 1e-3, 3e-3)
VALIDATION_MAZES = 64
CHOSEN_BY = 16  # the rate of the best validation pass@16


def load_config(tiny: bool, maze_size: int | None = None):
  config = configs.load("maze")
  config.num_validation_mazes = VALIDATION_MAZES
  if maze_size is not None:
    config.maze_size = maze_size
  if tiny:  # a smoke run of the pipeline: small mazes, a small policy, few steps
    config.update(dict(dim=32, num_layers=1, num_heads=2, num_train_mazes=32, batch_size=8,
                       num_eval_mazes=8, num_validation_mazes=8, eval_batch_size=8,
                       warmup_steps=20, num_steps=30, checkpoint_every=15))
  config.eval_every = config.num_steps  # one evaluation, at the end
  return config


def run_config(config, **settings):
  """A copy of `config` with `settings` (a run's method, seed, rate)."""
  config = config.copy_and_resolve_references()
  config.update(settings)
  return config


def warm_start_pass_at_k(task: MazeTask, seeds) -> dict[int, list[float]]:
  """{seed: pass@k right after the supervised warm start} (identical for every method), every
  seed reusing `task`'s compiled steps."""
  scores = {}
  for seed in seeds:
    seeded = common.seeded(task, run_config(task.config, seed=seed))  # the batch order
    state = seeded.init_state(jax.random.PRNGKey(seed))
    for step in range(task.config.warmup_steps):
      state, _ = seeded.train_step(state, step)
    evaluated = seeded.evaluate(state)
    scores[seed] = [evaluated[f"pass@{k}"] for k in PASS_AT_K]
  return scores


REFERENCES = (WARM_START, MAZE_BLIND)  # not RL methods: no paired difference to uniform


def tune_and_train(config, methods, seeds, learning_rates, tuning_seeds, workdir, start,
                   one_by_one=False) -> dict[str, common.TunedRuns]:
  """{method: its runs (the last metric row of each) at the rate chosen on validation}; each
  method's tuning grid trains as one batch, then its reported seeds as another."""
  tuned = {}
  for method in methods:

    def train_grid(points, method=method):
      runs = [run_config(config, method=method, seed=seed, learning_rate=rate)
              for rate, seed in points]
      labels = [f"{method} lr {rate:g} seed {seed}" for rate, seed in points]
      trained = common.train_or_read_batch(
          runs, [os.fspath(workdir / f"{method}-lr{rate:g}-seed{seed}") for rate, seed in points],
          labels, one_by_one=one_by_one)
      lasts = []
      for label, run in zip(labels, trained, strict=True):
        if run.stopped_at is not None:
          print(f"{label}: went non-finite at step {run.stopped_at}", flush=True)
          lasts.append(common.nan_scores(PASS_AT_K))
          continue
        last = [row for row in run.rows if "pass@1" in row][-1]
        print(f"{label}: validation pass@{CHOSEN_BY} {last[f'validation/pass@{CHOSEN_BY}']:.3f}; "
              f"held-out pass@1 {last['pass@1']:.3f} pass@256 {last['pass@256']:.3f}  "
              f"({time.time() - start:.0f} s)", flush=True)
        lasts.append(last)
      return lasts

    tuned[method] = common.tune_then_repeat(
        train_grid, learning_rates, seeds, lambda row: row[f"validation/pass@{CHOSEN_BY}"],
        tuning_seeds=tuning_seeds)
    common.print_choice(method, f"pass@{CHOSEN_BY}", tuned[method])
  return tuned


def write_rates_csv(tuned: dict[str, common.TunedRuns], path: str) -> None:
  """The whole grid: validation and held-out pass@k of every tuning run."""
  files.write_csv(path, [
      {"method": method, "learning_rate": rate, "seed": seed, "chosen": rate == runs.rate,
       **{f"validation_pass@{k}": f"{row[f'validation/pass@{k}']:.4f}" for k in PASS_AT_K},
       **{f"held_out_pass@{k}": f"{row[f'pass@{k}']:.4f}" for k in PASS_AT_K}}
      for method, runs in tuned.items() for (rate, seed), row in common.grid_runs(runs)])


def plot_rates(tuned: dict[str, common.TunedRuns], path: str, num_tuning_seeds: int) -> None:
  fig, axis = plt.subplots(figsize=(5, 3.8))
  for method, runs in tuned.items():
    common.plot_rate_sensitivity(axis, runs, label=method)
  axis.set(ylabel=f"validation pass@{CHOSEN_BY} (mean of {num_tuning_seeds} seeds)",
           title="maze: each method's RL learning rate (star: chosen)")
  axis.legend(fontsize=8)
  fig.tight_layout()
  save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> None:
  parser = common.figure_parser("maze", __doc__)
  parser.add_argument("--tiny", action="store_true", help="a small smoke run")
  parser.add_argument("--seeds", type=int, default=10, help="seeds 0, 1, ..., SEEDS-1")
  parser.add_argument("--tuning-seeds", type=int, default=2,
                      help="how many tuning seeds (100, 101, ...; never reported) train at "
                      "every rate (default 2)")
  parser.add_argument("--learning-rates", nargs="+", type=float, default=list(LEARNING_RATES),
                      help="the grid each method chooses its RL rate from")
  parser.add_argument("--methods", nargs="+", default=["sera", "uniform", "grpo"])
  parser.add_argument("--maze-size", type=int, default=None,
                      help="odd side of the mazes (default the config's, 9). At 9x9 the 256 "
                      "training mazes have only 40 distinct solutions, so replaying them earns "
                      "the training reward; at 13x13 they have 196 (see docs/figures.md)")
  parser.add_argument("--workdir", default=None, help="default runs/maze_passk[_tiny]")
  common.add_one_by_one(parser)
  args = parser.parse_args(argv)
  if args.tuning_seeds < 1:
    parser.error("--tuning-seeds must be >= 1")
  tuning_seeds = common.tuning_seeds(args.tuning_seeds)
  common.check_reported_seeds(parser, list(range(args.seeds)), tuning_seeds)
  if not all(rate > 0 for rate in args.learning_rates):
    parser.error("every learning rate must be > 0")
  if args.maze_size is not None:
    try:
      maze_env.check_size(args.maze_size)
    except ValueError as error:
      parser.error(f"--maze-size: {error}")
  config = load_config(args.tiny, args.maze_size)
  workdir = files.path(args.workdir or "runs/" + NAME + "_tiny" * args.tiny)
  seeds = list(range(args.seeds))
  start = time.time()
  task = MazeTask(config)
  held_out = task.held_out
  print(f"held-out: {config.num_eval_mazes} mazes from {held_out.candidates} generated; "
        f"{held_out.seen_fraction:.1%} of those share their shortest path with a training maze; "
        f"validation: {config.num_validation_mazes} mazes whose paths neither shares",
        flush=True)
  blind = list(replay_pass_at_k(task.train_paths, task.eval_mazes))
  results = {WARM_START: warm_start_pass_at_k(task, seeds),
             MAZE_BLIND: dict.fromkeys(seeds, blind)}
  tuned = tune_and_train(config, args.methods, seeds, sorted(set(args.learning_rates)),
                         tuning_seeds, workdir, start, args.one_by_one)
  results |= {method: {seed: [row[f"pass@{k}"] for k in PASS_AT_K]
                       for seed, row in runs.runs.items()} for method, runs in tuned.items()}
  stem = NAME + "_tiny" * args.tiny
  png, csv = common.output_paths(args.out, stem)
  rates_png, rates_csv = common.output_paths(args.out, stem + RATES_SUFFIX)
  common.write_pass_at_k_csv(results, seeds, PASS_AT_K, csv, exclude=REFERENCES)
  write_rates_csv(tuned, rates_csv)
  plot_rates(tuned, rates_png, args.tuning_seeds)
  unseen = "unseen in training" if config.novel_eval_paths else "not filtered"
  rates = ", ".join(f"{method} {runs.rate:g}" for method, runs in tuned.items())
  common.plot_pass_at_k(
      results, seeds, PASS_AT_K, png, what="held-out mazes", exclude=REFERENCES,
      styles={WARM_START: dict(linestyle="--", color="gray"),
              MAZE_BLIND: dict(linestyle=":", color="black")},
      title=f"{config.maze_size}x{config.maze_size} mazes, B = {config.batch_size} x "
      f"{config.baseline_n} rollouts/step, {config.num_steps - config.warmup_steps} RL steps, "
      f"{len(seeds)} seeds, Adam at {rates} (chosen on validation mazes); "
      f"{config.num_eval_mazes} held-out mazes with paths {unseen} "
      f"({held_out.seen_fraction:.0%} of generated mazes share a training path)")
  print(common.pass_at_k_tables(results, seeds, PASS_AT_K, exclude=REFERENCES))
  all_zero = [seed for seed in seeds
              if all(results[method][seed][-1] == 0 for method in tuned)]
  print(f"seeds in which every method scores 0 at pass@{PASS_AT_K[-1]}: {len(all_zero)} "
        f"{all_zero}; their warm start's pass@{PASS_AT_K[-1]}: "
        + ", ".join(f"{results[WARM_START][seed][-1]:.3f}" for seed in all_zero))
  print(f"total {time.time() - start:.0f} s; wrote {png}, {csv}, {rates_png} and {rates_csv}")
