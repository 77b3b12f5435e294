"""`sera-jax sweep`: a grid of config overrides expanded into runs, run here or printed.

  sera-jax sweep --config NAME|FILE --grid 'method=sera,uniform' --grid 'seed=0,1,2'
                 [--workdir-root DIR] [--print-commands]

Each `--grid KEY=V1,V2,...` is one axis; the runs are the Cartesian product of
the axes, in the order given (the last axis varies fastest). Run i is exactly
the command `sera-jax train --config NAME|FILE --config.KEY=V ... --workdir
ROOT/KEY=V,KEY=V` (`--print-commands` prints these lines for a cluster
scheduler). Otherwise they run here, in this process: the runs that differ only
in keys a batch may vary (the seed and the optimizer's scalars of the
classification and maze settings) train together as one program
(`sera_jax.harness.batched.run_batch`, each run writing its own workdir as
`train` does), every other run by itself, one after another (all of them with
--one-by-one). A run whose workdir already holds all num_steps metric rows and its final
checkpoint (or the mark of the batch that trained it, to the end or to the step where the
run went non-finite) is skipped, so an interrupted sweep is finished by running it again
(partial runs and batches resume from their checkpoint, each as it was trained: batched or
alone).
Values cannot contain commas.
"""

import argparse
import dataclasses
import itertools
import os
import pathlib
import shlex
from collections.abc import Callable, Sequence

from absl import flags

from sera_jax.common import files
from sera_jax.harness import batched, configs, train


@dataclasses.dataclass(frozen=True)
class Run:
  """One point of the grid: its overrides (key -> value text) and its workdir."""
  overrides: tuple[tuple[str, str], ...]
  workdir: str

  def train_args(self, config_path: str) -> list[str]:
    """The arguments of `sera-jax train` for this run."""
    return [f"--config={config_path}", *(f"--config.{k}={v}" for k, v in self.overrides),
            f"--workdir={self.workdir}"]


def parse_axis(spec: str) -> tuple[str, list[str]]:
  """'method=sera,uniform' -> ('method', ['sera', 'uniform'])."""
  key, sep, values = spec.partition("=")
  key = key.strip().removeprefix("config.")
  items = [v.strip() for v in values.split(",")]
  if not sep or not key or not all(items):
    raise ValueError(f"--grid takes KEY=V1,V2,... (no empty key or value); got {spec!r}.")
  if len(set(items)) != len(items):
    raise ValueError(f"--grid {spec!r} repeats a value.")
  return key, items


def workdir_name(overrides: Sequence[tuple[str, str]]) -> str:
  """The workdir of a run, 'KEY=V,KEY=V' (a '/' in a value becomes '_')."""
  return ",".join(f"{key}={value.replace('/', '_')}" for key, value in overrides)


def expand(axes: Sequence[tuple[str, list[str]]], workdir_root: str) -> list[Run]:
  """The runs of the grid: the Cartesian product of the axes, last axis fastest."""
  keys = [key for key, _ in axes]
  repeated = sorted({key for key in keys if keys.count(key) > 1})
  if repeated:
    raise ValueError(f"--grid names {', '.join(repeated)} more than once.")
  runs = []
  for values in itertools.product(*(values for _, values in axes)):
    overrides = tuple(zip(keys, values, strict=True))
    runs.append(Run(overrides, os.path.join(workdir_root, workdir_name(overrides))))
  return runs


def is_done(workdir: str, num_steps: int) -> bool:
  """True when the run in `workdir` needs no more training: the batch that trained it ended
  after `num_steps` steps (`batched.run_outcome`) with a row a step up to the end or up to
  the step where the run went non-finite, or, trained alone, it holds a row a step and its
  final checkpoint."""
  steps = [row["step"] for row in train.read_metrics(workdir)]
  outcome = batched.run_outcome(workdir)
  if outcome is not None and outcome.num_steps == num_steps:
    end = num_steps if outcome.stopped_at is None else outcome.stopped_at
    return steps == list(range(end))
  final_checkpoint = files.path(workdir) / train.CHECKPOINT_DIR / str(num_steps)
  return steps == list(range(num_steps)) and final_checkpoint.is_dir()


def resolve_config(config_path: str, run: Run):
  """The config `sera-jax train` would run for `run` (overrides parsed as the CLI does),
  checked as `train.run` checks it before it builds its task."""
  try:
    config = configs.train_flags(["sera-jax train", *run.train_args(config_path)]).config
    train.check_config(config)
  except (flags.Error, AttributeError, KeyError, ValueError, TypeError,
          FileNotFoundError) as error:
    raise SystemExit(f"error: {run.workdir}: {error}") from None
  return config


def _parse(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="sera-jax sweep", description=__doc__.split("\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default=configs.DEFAULT,
                      help=configs.help_text())
  parser.add_argument("--grid", action="append", required=True, metavar="KEY=V1,V2,...",
                      help="One axis of the grid (repeat for more axes).")
  parser.add_argument("--workdir-root", default=None,
                      help="Parent of the run workdirs (default runs/sweep-<config name>).")
  parser.add_argument("--print-commands", action="store_true",
                      help="Print one `sera-jax train` command line per run; run nothing.")
  parser.add_argument("--one-by-one", action="store_true",
                      help="Train every run by itself, none batched with others.")
  return parser.parse_args(argv)


def main(argv: list[str], train_command: Callable[[list[str]], None]) -> list[Run]:
  """Runs (or prints) the sweep of `argv`; returns the runs of the grid.

  Args:
    argv: the arguments after `sera-jax sweep`.
    train_command: runs `sera-jax train` with the given arguments (cli.train).
  """
  args = _parse(argv)
  try:
    task = configs.load(args.config).get("task")
  except FileNotFoundError as error:
    raise SystemExit(f"error: {error}") from None
  if task not in train.SETTINGS:
    *others, last = train.SETTINGS
    raise SystemExit(f"error: sera-jax sweep trains configs of the {', '.join(others)} and {last} "
                     f"settings; {args.config}'s task is {task!r} (train it with sera-jax "
                     f"train, one run at a time).")
  root = args.workdir_root or os.path.join("runs", f"sweep-{pathlib.Path(args.config).stem}")
  try:
    runs = expand([parse_axis(spec) for spec in args.grid], root)
  except ValueError as error:
    raise SystemExit(f"error: {error}") from None
  # Every run's overrides are checked before the first one starts.
  run_configs = [resolve_config(args.config, run) for run in runs]
  if args.print_commands:
    for run in runs:
      print(shlex.join(["sera-jax", "train", *run.train_args(args.config)]))
    return runs
  pending = []
  for index, (run, config) in enumerate(zip(runs, run_configs, strict=True), start=1):
    try:
      train.check_same_run(config, run.workdir)
    except ValueError as error:
      raise SystemExit(f"error: {error}") from None
    if is_done(run.workdir, config.num_steps):
      outcome = batched.run_outcome(run.workdir)
      how = (f"stopped at step {outcome.stopped_at}, non-finite" if outcome and
             outcome.stopped_at is not None else f"finished ({config.num_steps} steps)")
      print(f"[{index}/{len(runs)}] skip {run.workdir}: {how}")
    else:
      pending.append((index, run, config))
  groups = ([[i] for i in range(len(pending))] if args.one_by_one
            else batched.batch_groups([config for _, _, config in pending]))
  for group in groups:
    members = [pending[i] for i in group]
    if len(members) == 1:
      (index, run, _), = members
      print(f"[{index}/{len(runs)}] train {run.workdir}", flush=True)
      train_command(run.train_args(args.config))
      continue
    indices = ",".join(str(index) for index, _, _ in members)
    print(f"[{indices}/{len(runs)}] train as one batch: "
          f"{' '.join(run.workdir for _, run, _ in members)}", flush=True)
    try:
      batched.run_batch([config for _, _, config in members],
                        [run.workdir for _, run, _ in members])
    except ValueError as error:
      raise SystemExit(f"error: {error}") from None
  return runs
