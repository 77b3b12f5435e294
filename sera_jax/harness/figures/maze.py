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
import numpy as np

from sera_jax.common import files
from sera_jax.common.plots import plt, save_figure
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


def paired_differences(results: dict, seeds: list[int], baseline: str = "uniform") -> dict:
  """{"M - baseline": [[difference per k] per seed]} for every RL method M beside the baseline."""
  if baseline not in results:
    return {}
  reference = np.array([results[baseline][s] for s in seeds])
  return {f"{method} - {baseline}": np.array([per_seed[s] for s in seeds]) - reference
          for method, per_seed in results.items()
          if method not in (baseline, WARM_START, MAZE_BLIND)}


def write_csv(results: dict, seeds: list[int], path: str) -> None:
  rows = [row for method, per_seed in results.items()
          for row in common.per_seed_rows({"method": method}, [per_seed[s] for s in seeds],
                                           seeds, PASS_AT_K, digits=4)]
  rows += [row for name, values in paired_differences(results, seeds).items()
           for row in common.per_seed_rows({"method": name}, values, seeds, PASS_AT_K,
                                           digits=4)]
  files.write_csv(path, rows)


def plot(results: dict, seeds: list[int], config, held_out, path: str) -> None:
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  styles = {WARM_START: dict(linestyle="--", color="gray"),
            MAZE_BLIND: dict(linestyle=":", color="black")}
  for method, per_seed in results.items():
    values = np.array([per_seed[s] for s in seeds])
    left.errorbar(PASS_AT_K, values.mean(0), yerr=values.std(0), marker="o", capsize=3,
                  label=method, **styles.get(method, {}))
  for name, diff in paired_differences(results, seeds).items():
    mean, half = common.mean_interval(diff, axis=0)
    right.errorbar(PASS_AT_K, mean, yerr=half, marker="o", capsize=3, label=name)
  right.axhline(0.0, color="black", linewidth=0.8)
  left.set(ylabel="pass@k (held-out mazes, mean ± std)")
  right.set(ylabel="pass@k difference, paired by seed (95% CI)")
  for axis in (left, right):
    axis.set_xscale("log", base=2)
    axis.set_xlabel("k")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
  unseen = "unseen in training" if config.novel_eval_paths else "not filtered"
  fig.suptitle(f"{config.maze_size}x{config.maze_size} mazes, B = {config.batch_size} x "
               f"{config.baseline_n} rollouts/step, {config.num_steps - config.warmup_steps} RL "
               f"steps, {len(seeds)} seeds; {config.num_eval_mazes} held-out mazes with paths "
               f"{unseen} ({held_out.seen_fraction:.0%} of generated mazes share a training path)",
               fontsize=9)
  fig.tight_layout()
  save_figure(fig, path, dpi=120)


def _table(rows: dict[str, tuple[np.ndarray, np.ndarray]], *, signed: bool) -> str:
  """A markdown table of "centre ± spread" per k, one row per name."""
  number = "{:+.3f}" if signed else "{:.3f}"
  lines = [f"| | {' | '.join(f'pass@{k}' for k in PASS_AT_K)} |",
           f"|---|{'---|' * len(PASS_AT_K)}"]
  for name, (centre, spread) in rows.items():
    cells = " | ".join(f"{number.format(c)} ± {h:.3f}"
                       for c, h in zip(centre, spread, strict=True))
    lines.append(f"| {name} | {cells} |")
  return "\n".join(lines)


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
  write_csv(results, seeds, csv)
  plot(results, seeds, config, held_out, png)
  spread = {method: (np.mean(v := np.array([per_seed[s] for s in seeds]), 0), np.std(v, 0))
            for method, per_seed in results.items()}
  print(_table(spread, signed=False))
  print("\npaired by seed, mean and 95% interval:")
  print(_table({name: common.mean_interval(diff, axis=0)
                for name, diff in paired_differences(results, seeds).items()}, signed=True))
  print(f"total {time.time() - start:.0f} s; wrote {png} and {csv}")
