"""The `sera-jax` command.

  sera-jax train [--config NAME|FILE] [--config.KEY=VALUE ...] [--workdir DIR] [--resume]
                 [--multihost [--coordinator HOST:PORT --num_processes N --process_id I]]
  sera-jax plot RUN_DIR [RUN_DIR ...] [--out FILE.png] [--window N]
  sera-jax sweep [--config NAME|FILE] --grid KEY=V1,V2,... [--grid ...] [--workdir-root DIR]
                 [--print-commands] [--one-by-one]
  sera-jax figure budget|scale|ablations|outcome|maze|math|scaling|sim [--out DIR] ...
  sera-jax figure --list
  sera-jax evaluate [--config NAME|FILE] [--config.KEY=VALUE ...] --data [NAME:]FORMAT=PATH
                    [--data ...] [--samples N] [--out DIR] [--step STEP] ...

With no arguments `train` runs the shipped config `default` (SERA on the
embedded digits) into runs/default-sera. Shipped configs: CONFIGS.
A gsm8k config trains through Tunix (the [llm] extra) and writes only to its
config.checkpoint_dir and config.log_dir, so it takes no --workdir or --resume.
Every figure writes its PNG, CSV and manifest (how it was made) into the
directory --out (default docs/figures); `figure --list` prints each figure,
its cost on a 2-core CPU and when its manifest there was written.
`evaluate` scores an LLM config's policy (default gsm8k_qwen3:
config.model_dir's weights, or the actor trained into config.checkpoint_dir)
on problem files: pass@k, mean@n and greedy accuracy into --out. `sera-jax
COMMAND --help` lists a command's options.
"""

import importlib
import json
import os
import pathlib
import sys

from absl import flags
from ml_collections import config_flags

from sera_jax.common import files
from sera_jax.harness import configs

USAGE = __doc__.replace("CONFIGS", ", ".join(configs.names()))
TRAIN_USAGE = "usage:" + USAGE.split("  sera-jax plot")[0].split("command.")[1].rstrip()
EVALUATE_USAGE = "usage:\n" + USAGE[USAGE.index("  sera-jax evaluate"):].split("\n\n")[0]
FIGURES = ("budget", "scale", "ablations", "outcome", "maze", "math", "scaling", "sim")
LOOP_TASKS = ("classification", "maze", "sim")  # sera_jax.harness.train's; "gsm8k" is Tunix's


def _ending_on_checkpoint_errors(function, *args, **kwargs):
  """function(*args, **kwargs), or the process ended with one line where it could not
  restore a checkpoint (sera_jax.harness.train.CheckpointError)."""
  from sera_jax.harness import train as training
  try:
    return function(*args, **kwargs)
  except training.CheckpointError as error:
    # Orbax's other reads of the failed restore are still pending; closed at interpreter exit,
    # some (which ones depends on thread timing) would print their TensorStore tracebacks after
    # this line. Nothing is left to clean up: the failed restore wrote nothing, and runs before
    # it (a sweep's, a figure's) closed their files. One write keeps the line whole where those
    # threads' lines already interleave with it.
    sys.stderr.write(f"error: {error}\n")
    sys.stderr.flush()
    os._exit(1)


def train(argv: list[str]) -> None:
  """Trains one config into a workdir (resuming it when it holds checkpoints)."""
  argv = ["sera-jax train", *argv]
  if "--help" in argv or "-h" in argv:
    print(TRAIN_USAGE)
    print(configs.train_flags(["sera-jax train"]).module_help(configs.__name__))
    return
  try:
    values = configs.train_flags(argv)
  except (flags.Error, AttributeError, KeyError, ValueError, FileNotFoundError) as error:
    raise SystemExit(f"error: {error}") from None
  task = values.config.get("task")
  if task == "gsm8k":
    train_llm(values)
    return
  if task not in LOOP_TASKS:
    raise SystemExit(f"error: sera-jax train runs a config whose task is one of "
                     f"{', '.join((*LOOP_TASKS, 'gsm8k'))}; got {task!r} (a figure's config, "
                     f"like math, runs with `sera-jax figure`).")
  multihost_only = [f"--{name}" for name in ("coordinator", "num_processes", "process_id")
                    if values[name].present]
  if multihost_only and not values.multihost:
    raise SystemExit(f"error: {', '.join(multihost_only)}: settings of a multi-host job, "
                     f"given without --multihost.")
  if values.multihost:
    from sera_jax.common import sharding
    try:
      sharding.initialize_distributed(values.coordinator, values.num_processes,
                                      values.process_id)
    except (ValueError, RuntimeError) as error:
      raise SystemExit(f"error: --multihost: {error}") from None
  from sera_jax.harness import train as training

  config = values.config
  config_name = pathlib.Path(values["config"].config_filename).stem
  workdir = values.workdir or os.path.join("runs", f"{config_name}-{config.get('method', 'run')}")
  try:
    training.check_same_run(config, workdir)
    rows = _ending_on_checkpoint_errors(training.run, config, workdir, resume=values.resume)
  except (ValueError, TypeError, FileNotFoundError, training.NonFiniteError) as error:
    raise SystemExit(f"error: {error}") from None
  except files.storage_errors() as error:
    raise SystemExit(f"error: workdir {workdir}: {error}") from None
  if rows:
    print(json.dumps(rows[-1]))
    summary = training.summarize([r for r in rows if "cos/sera_expected" in r])
    for name in ("cos/sera_expected", "cos/uniform_expected", "cos/sera_realized",
                 "cos/uniform_realized"):
      if name in summary:
        print(f"mean {name}: {summary[name]:.4f}")
  print(f"outputs in {workdir}")


def train_llm(values: flags.FlagValues) -> None:
  """Trains a gsm8k config with SeraLearner (sera_jax.settings.llm.gsm8k), resuming from
  config.checkpoint_dir when it holds checkpoints."""
  loop_only = [f"--{name}" for name in ("workdir", "resume", "multihost") if values[name].present]
  if loop_only:
    raise SystemExit(f"error: {', '.join(loop_only)}: a gsm8k config trains in one process and "
                     f"writes to config.checkpoint_dir (resumed when it holds checkpoints) and "
                     f"config.log_dir.")
  try:
    from sera_jax.settings.llm import gsm8k
  except ImportError as error:
    raise SystemExit(f"error: a gsm8k config needs the [llm] extra "
                     f"(pip install -e '.[llm]'): {error}") from None
  try:
    learner = gsm8k.train(values.config)
  except (ValueError, TypeError, FileNotFoundError) as error:
    raise SystemExit(f"error: {error}") from None
  last = "none trained now" if learner.last_counts is None else learner.last_counts.tolist()
  print(f"{learner.batches_seen} batches of {values.config.batch_size} problems allocated; "
        f"the last one's rollouts per prompt: {last}")


def plot(argv: list[str]) -> None:
  """Overlays the alignment curves of run directories (sera_jax.harness.plotting); writes the
  picture, its CSV and its manifest (this command and each run's config)."""
  import argparse

  from sera_jax.harness import plotting
  from sera_jax.harness.figures import common
  figure_run = common.start_figure()
  parser = argparse.ArgumentParser(prog="sera-jax plot", description=plot.__doc__)
  parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
  parser.add_argument("--out", default="alignment_runs.png", help="PNG path (or another format "
                      "matplotlib writes, by its suffix); the CSV of the plotted series goes "
                      "next to it with suffix .csv.")
  parser.add_argument("--window", type=int, default=20, help="Moving-average window (>= 1).")
  args = parser.parse_args(argv)
  if args.window < 1:
    parser.error(f"--window must be >= 1; got {args.window}.")
  if not pathlib.Path(args.out).suffix:
    parser.error(f"--out needs a file suffix that names the format (.png, .pdf, .svg); got "
                 f"{args.out!r}.")
  try:
    runs = plotting.plot_runs(args.run_dirs, args.out, window=args.window)
  except (FileNotFoundError, ValueError) as error:  # ValueError: a format matplotlib lacks
    raise SystemExit(f"error: {error}") from None
  out = files.path(args.out)
  manifest = common.write_manifest(
      os.fspath(out.parent), out.stem, figure_run, command="plot", argv=argv,
      seeds=sorted({config["seed"] for config in runs.values() if "seed" in config}),
      tuning_seeds=[], protocol={"runs": runs, "window": args.window})
  print(f"wrote {args.out}, its .csv and {manifest} ({', '.join(runs)})")


def sweep(argv: list[str]) -> None:
  """Runs or prints a grid of `train` runs (sera_jax.harness.sweep)."""
  from sera_jax.harness import sweep as sweeping
  _ending_on_checkpoint_errors(sweeping.main, argv, train_command=train)


def list_figures() -> None:
  """Prints each figure: its name, its cost on a 2-core CPU, when its manifest in its default
  --out directory was written (and at which commit)."""
  from sera_jax.harness.figures import common
  for name in FIGURES:
    module = importlib.import_module(f"sera_jax.harness.figures.{name}")
    out = getattr(module, "OUT_DIR", common.OUT_DIR)
    manifest = common.read_manifest(out, module.NAME)
    made = (f"made {manifest['made_at']} at {manifest['git_commit'][:7] or 'no commit'}"
            if manifest else f"no manifest in {out}")
    print(f"{name:10s} {module.CPU_COST:42s} {made}")


def figure(argv: list[str]) -> None:
  """Runs a figure experiment of sera_jax.harness.figures: its arguments follow the name."""
  if argv == ["--list"]:
    return list_figures()
  if not argv or argv[0] not in FIGURES:
    raise SystemExit(f"error: sera-jax figure needs one of {', '.join(FIGURES)}; "
                     f"`sera-jax figure NAME --help` lists its options.")
  _ending_on_checkpoint_errors(
      importlib.import_module(f"sera_jax.harness.figures.{argv[0]}").main, argv[1:])


def evaluate_flags(argv: list[str]) -> flags.FlagValues:
  """The parsed flags of `sera-jax evaluate` (argv[0] is the program name)."""
  from sera_jax.settings.llm import data
  argv = configs.resolve_config_argument(argv)  # a shipped config's name -> its file
  values = flags.FlagValues()
  config_flags.DEFINE_config_file(
      "config", str(configs.config_file("gsm8k_qwen3")), configs.help_text(),
      flag_values=values, lock_config=True, sys_argv=argv)
  flags.DEFINE_multi_string(
      "data", [], f"A benchmark, [NAME:]FORMAT=PATH: a .parquet or .jsonl problem file (local or "
      f"gs://) in one of the formats {', '.join(data.FORMATS)} (sera_jax.settings.llm.data); "
      f"NAME (default the file's name) labels its results",
      flag_values=values)
  flags.DEFINE_integer("samples", 16, "n: sampled completions a problem.", lower_bound=1,
                       flag_values=values)
  flags.DEFINE_string("out", "eval", "Output directory (local or gs://): pass_at_k.csv, "
                      "pass_at_k.png, samples.jsonl.", flag_values=values)
  flags.DEFINE_integer("step", None, "The step of config.checkpoint_dir to evaluate "
                       "(default its latest).", flag_values=values)
  flags.DEFINE_bool("greedy", True, "Also score one greedy completion a problem.",
                    flag_values=values)
  flags.DEFINE_float("top_p", 1.0, "Nucleus of the sampled completions (their temperature is "
                     "config.temperature).", flag_values=values)
  flags.DEFINE_integer("seed", 0, "Seed of the sampling keys.", flag_values=values)
  flags.DEFINE_integer("grading_processes", min(8, os.cpu_count() or 1),
                       "Worker processes grading MATH-style answers with math-verify.",
                       lower_bound=1, flag_values=values)
  flags.DEFINE_float("grading_deadline", 10.0, "Seconds an answer may take to grade; one that "
                     "takes longer is graded 0.", flag_values=values)
  values(argv)
  return values


def evaluate(argv: list[str]) -> None:
  """Scores an LLM config's policy on benchmark files (sera_jax.settings.llm.evaluate)."""
  argv = ["sera-jax evaluate", *argv]
  try:
    from sera_jax.settings.llm import evaluate as evaluation
  except ImportError as error:
    raise SystemExit(f"error: sera-jax evaluate needs the [llm] extra "
                     f"(pip install -e '.[llm]'): {error}") from None
  if "--help" in argv or "-h" in argv:
    print(EVALUATE_USAGE)
    print(evaluate_flags(["sera-jax evaluate"]).module_help(__name__))
    return
  try:
    values = evaluate_flags(argv)
    if values.config.get("task") != "gsm8k":
      raise ValueError(f"sera-jax evaluate scores the policy of an LLM config (task gsm8k, "
                       f"like gsm8k_qwen3); got task {values.config.get('task')!r}.")
    if not values.data:
      raise ValueError("give at least one benchmark: --data [NAME:]FORMAT=PATH.")
    rows = evaluation.evaluate(
        values.config, [evaluation.parse_benchmark(spec) for spec in values.data], values.out,
        samples=values.samples, greedy=values.greedy, top_p=values.top_p, seed=values.seed,
        step=values.step, grading_processes=values.grading_processes,
        grading_deadline_s=values.grading_deadline)
  except (flags.Error, AttributeError, KeyError, ValueError, TypeError,
          FileNotFoundError) as error:
    raise SystemExit(f"error: {error}") from None
  for row in rows:
    print(json.dumps(row))
  print(f"outputs in {values.out}")


COMMANDS = {"train": train, "plot": plot, "sweep": sweep, "figure": figure, "evaluate": evaluate}


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
