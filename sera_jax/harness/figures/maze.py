"""Pass@k of SERA, uniform MaxRL and GRPO on held-out mazes.

For each seed, every method starts from the same supervised warm start (same
seed, same steps) and then trains with the same rollout budget B = M * N0 per
step; pass@k (k = 1, 2, ..., 256, unbiased, from 256 samples a maze) is
measured on the held-out mazes after the warm start and at the end of RL. The
held-out mazes' shortest paths occur in no training maze, and `maze-blind`, a
policy replaying training solutions, is the memorisation baseline (exact).

  sera-jax figure maze            # CPU config, 3 methods x 5 seeds (~15 min)
  sera-jax figure maze --tiny     # a smoke run (about 1.5 minutes for 2 seeds)

Writes maze_passk.png and maze_passk.csv (mean, std, 95% interval and every
seed's value, and the paired differences to uniform) into --out, and one
training workdir per run under --workdir
(metrics.jsonl, TensorBoard, checkpoints; reruns resume). --tiny names its
figure and CSV maze_passk_tiny and trains under runs/maze_passk_tiny.
"""

import os
import time

import jax

from sera_jax.common import files
from sera_jax.harness import configs, train
from sera_jax.harness.figures import common
from sera_jax.settings.maze.task import PASS_AT_K, MazeTask, replay_pass_at_k

NAME = "maze_passk"
WARM_START = "warm start"
MAZE_BLIND = "maze-blind"  # replays training solutions, whatever the maze


def load_config(tiny: bool):
  config = configs.load("maze")
  if tiny:
    config.update(dict(num_train_mazes=32, batch_size=8, num_eval_mazes=16, warmup_steps=20,
                       num_steps=40, checkpoint_every=20))
  config.eval_every = config.num_steps  # one evaluation, at the end
  return config


def warm_start_pass_at_k(config, seed: int) -> list[float]:
  """pass@k right after the supervised warm start (identical for every method)."""
  task = MazeTask(config)
  state = task.init_state(jax.random.PRNGKey(seed))
  for step in range(config.warmup_steps):
    state, _ = task.train_step(state, step)
  scores = task.evaluate(state)
  return [scores[f"pass@{k}"] for k in PASS_AT_K]


REFERENCES = (WARM_START, MAZE_BLIND)  # not RL methods: no paired difference to uniform


def main(argv: list[str] | None = None) -> None:
  parser = common.figure_parser("maze", __doc__)
  parser.add_argument("--tiny", action="store_true", help="a small smoke run")
  parser.add_argument("--seeds", type=int, default=5)
  parser.add_argument("--methods", nargs="+", default=["sera", "uniform", "grpo"])
  parser.add_argument("--workdir", default=None, help="default runs/maze_passk[_tiny]")
  args = parser.parse_args(argv)
  config = load_config(args.tiny)
  workdir = files.path(args.workdir or "runs/" + NAME + "_tiny" * args.tiny)
  seeds = list(range(args.seeds))
  start = time.time()
  task = MazeTask(config)
  held_out = task.held_out
  print(f"held-out: {config.num_eval_mazes} mazes from {held_out.candidates} generated; "
        f"{held_out.seen_fraction:.1%} of those share their shortest path with a training maze",
        flush=True)
  blind = list(replay_pass_at_k(task.train_paths, task.eval_mazes))
  results = {WARM_START: {}, MAZE_BLIND: dict.fromkeys(seeds, blind)}
  results |= {method: {} for method in args.methods}
  for seed in seeds:
    config.seed = seed
    results[WARM_START][seed] = warm_start_pass_at_k(config, seed)
    for method in args.methods:
      config.method = method
      run_dir = os.fspath(workdir / f"{method}-seed{seed}")
      try:
        train.check_same_run(config, run_dir)
      except ValueError as error:
        raise SystemExit(f"error: {error}") from None
      rows = train.run(config, run_dir)
      last = [row for row in rows if "pass@1" in row][-1]
      results[method][seed] = [last[f"pass@{k}"] for k in PASS_AT_K]
      print(f"seed {seed} {method}: pass@1 {last['pass@1']:.3f}  pass@256 "
            f"{last['pass@256']:.3f}  ({time.time() - start:.0f} s)", flush=True)
  png, csv = common.output_paths(args.out, NAME + "_tiny" * args.tiny)
  common.write_pass_at_k_csv(results, seeds, PASS_AT_K, csv, exclude=REFERENCES)
  unseen = "unseen in training" if config.novel_eval_paths else "not filtered"
  common.plot_pass_at_k(
      results, seeds, PASS_AT_K, png, what="held-out mazes", exclude=REFERENCES,
      styles={WARM_START: dict(linestyle="--", color="gray"),
              MAZE_BLIND: dict(linestyle=":", color="black")},
      title=f"{config.maze_size}x{config.maze_size} mazes, B = {config.batch_size} x "
      f"{config.baseline_n} rollouts/step, {config.num_steps - config.warmup_steps} RL steps, "
      f"{len(seeds)} seeds; {config.num_eval_mazes} held-out mazes with paths {unseen} "
      f"({held_out.seen_fraction:.0%} of generated mazes share a training path)")
  print(common.pass_at_k_tables(results, seeds, PASS_AT_K, exclude=REFERENCES))
  print(f"total {time.time() - start:.0f} s; wrote {png} and {csv}")
