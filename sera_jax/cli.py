"""The `sera-jax` command.

  sera-jax train [--config FILE] [--config.KEY=VALUE ...] [--workdir DIR] [--resume]
                 [--multihost [--coordinator HOST:PORT --num_processes N --process_id I]]
  sera-jax plot RUN_DIR [RUN_DIR ...] [--out FILE] [--window N]
  sera-jax sweep [--config FILE] --grid KEY=V1,V2,... [--grid ...] [--workdir-root DIR]
                 [--print-commands]
  sera-jax figure budget|scale|ablations|outcome [--out DIR] [--seeds N] ...   (experiments/*.py)

With no arguments `train` runs experiments/configs/default.py (SERA on the
embedded digits) into runs/default-sera.
"""

import json
import os
import pathlib
import sys

from absl import flags
from ml_collections import config_flags

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "experiments" / "configs" / "default.py"
USAGE = __doc__


def _train_flags(argv: list[str]) -> flags.FlagValues:
  values = flags.FlagValues()
  # config_flags reads the --config.KEY overrides from sys_argv when defining them.
  config_flags.DEFINE_config_file("config", str(DEFAULT_CONFIG), "Experiment config file.",
                                  flag_values=values, lock_config=True, sys_argv=argv)
  flags.DEFINE_string("workdir", None, "Output directory (default runs/<config>-<method>).",
                      flag_values=values)
  flags.DEFINE_bool("resume", False, "Require and resume from the workdir's latest checkpoint.",
                    flag_values=values)
  flags.DEFINE_bool("multihost", False, "Call jax.distributed.initialize() first.",
                    flag_values=values)
  flags.DEFINE_string("coordinator", None, "host:port of process 0 (multihost, outside "
                      "TPU/SLURM auto-detection).", flag_values=values)
  flags.DEFINE_integer("num_processes", None, "Number of processes (multihost).",
                       flag_values=values)
  flags.DEFINE_integer("process_id", None, "This process's id (multihost).", flag_values=values)
  return values


def train(argv: list[str]) -> None:
  argv = ["sera-jax train", *argv]
  values = _train_flags(argv)
  try:
    values(argv)
  except (flags.Error, AttributeError, KeyError, ValueError) as error:
    raise SystemExit(f"error: {error}") from None
  if values.multihost:
    from sera_jax import sharding
    sharding.initialize_distributed(values.coordinator, values.num_processes, values.process_id)
  from sera_jax import train as training

  config = values.config
  config_name = pathlib.Path(values["config"].config_filename).stem
  workdir = values.workdir or os.path.join("runs", f"{config_name}-{config.get('method', 'run')}")
  try:
    training.check_same_run(config, workdir)
    rows = training.run(config, workdir, resume=values.resume)
  except (ValueError, FileNotFoundError, training.NonFiniteError) as error:
    raise SystemExit(f"error: {error}") from None
  if rows:
    print(json.dumps(rows[-1]))
    summary = training.summarize([r for r in rows if "cos/sera_expected" in r])
    for name in ("cos/sera_expected", "cos/uniform_expected", "cos/sera_realized",
                 "cos/uniform_realized"):
      if name in summary:
        print(f"mean {name}: {summary[name]:.4f}")
  print(f"outputs in {workdir}")


def plot(argv: list[str]) -> None:
  """Overlays the alignment curves of run directories (sera_jax.plotting.plot_runs)."""
  import argparse

  from sera_jax import plotting
  parser = argparse.ArgumentParser(prog="sera-jax plot", description=plot.__doc__)
  parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
  parser.add_argument("--out", default="alignment_runs.png", help="PNG path; the CSV of the "
                      "plotted series goes next to it with suffix .csv.")
  parser.add_argument("--window", type=int, default=20, help="Moving-average window.")
  args = parser.parse_args(argv)
  try:
    labels = plotting.plot_runs(args.run_dirs, args.out, window=args.window)
  except FileNotFoundError as error:
    raise SystemExit(f"error: {error}") from None
  print(f"wrote {args.out} and its .csv ({', '.join(labels)})")


def sweep(argv: list[str]) -> None:
  """Runs or prints a grid of `train` runs (sera_jax.sweep)."""
  from sera_jax import sweep as sweeping
  sweeping.main(argv, train_command=train)


FIGURES = {"budget": "alignment_vs_budget", "scale": "scale_equalization",
           "ablations": "ablations", "outcome": "training_outcome"}


def figure(argv: list[str]) -> None:
  """Runs a figure script of experiments/ (sera_jax.figures): its arguments follow the name."""
  from sera_jax.config import load_module
  if not argv or argv[0] not in FIGURES:
    raise SystemExit(f"error: sera-jax figure needs one of {', '.join(FIGURES)}; "
                     f"`sera-jax figure NAME --help` lists its options.")
  load_module(REPO_ROOT / "experiments" / f"{FIGURES[argv[0]]}.py").main(argv[1:])


COMMANDS = {"train": train, "plot": plot, "sweep": sweep, "figure": figure}


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] in ("-h", "--help", "help"):
    print(USAGE)
    return
  command, *rest = argv
  if command not in COMMANDS:
    raise SystemExit(f"error: unknown command {command!r}; commands: {', '.join(COMMANDS)}.\n"
                     + USAGE)
  COMMANDS[command](rest)


if __name__ == "__main__":
  main()
