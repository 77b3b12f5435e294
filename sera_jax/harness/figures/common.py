"""Shared machinery of the figure experiments (`sera-jax figure NAME`).

* Snapshots: a `sera_jax.harness.train.run` of a classification config
  checkpointed at every epoch boundary (`train_for_snapshots`), restored by
  step (`load_state`); early / midway / late are epoch boundaries
  (`snapshot_steps`), so the historical estimate (docs/method.md#estimating-p) can be rebuilt
  from the checkpoints of the epochs before each one (`historical_log_p`).
* The command line every figure shares (`figure_parser`: `--out DIR`, where
  the figure writes NAME.png and NAME.csv) and the options of the snapshot
  run (`add_run_arguments`).
* Reporting: Student-t intervals, CSV rows per seed, text tables.

The methods a figure compares and their jitted evaluation live with the
setting, in `sera_jax.settings.classification.alignment`.
"""

import argparse
import copy
import json
import os
import pathlib
import subprocess
import textwrap
import time
from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from scipy import stats

from sera_jax.common import files
from sera_jax.common.plots import plt, save_figure
from sera_jax.harness import batched, configs, sweep, train
from sera_jax.method import success
from sera_jax.settings.classification import allocations, gradients
from sera_jax.settings.classification.task import ClassificationTask, TrainState

OUT_DIR = "docs/figures"
TaskT = TypeVar("TaskT")


# ----------------------------------------------------------------------------- snapshots


def snapshot_steps(num_steps: int, steps_per_epoch: int) -> dict[str, int]:
  """Early, midway and late epoch boundaries of a run: after epoch 1, at half, the last one."""
  last = (num_steps // steps_per_epoch) * steps_per_epoch
  if last < steps_per_epoch:
    raise ValueError(f"a run of {num_steps} steps does not finish one epoch of "
                     f"{steps_per_epoch} steps; train longer.")
  middle = max(round(num_steps / 2 / steps_per_epoch), 1) * steps_per_epoch
  return {"early": steps_per_epoch, "mid": middle, "late": last}


def train_for_snapshots(config: ml_collections.ConfigDict, workdir: str,
                        task: ClassificationTask) -> None:
  """Runs (or resumes, or finds finished) `config`'s `task` in `workdir` with a checkpoint
  per epoch."""
  steps_per_epoch = task.dataset.steps_per_epoch(config.batch_size)
  config.checkpoint_every = steps_per_epoch
  config.checkpoints_to_keep = config.num_steps // steps_per_epoch + 2
  train.check_same_run(config, workdir)
  train.run(config, workdir, task=task)


def load_state(task: ClassificationTask, workdir: str, step: int) -> TrainState:
  """The training state after `step` steps (step 0: the initial state)."""
  state = task.init_state(jax.random.PRNGKey(task.config.seed))
  if step == 0:
    return state
  path = files.path(workdir) / train.CHECKPOINT_DIR
  with ocp.CheckpointManager(path) as manager:
    if step not in manager.all_steps():
      raise FileNotFoundError(f"no checkpoint of step {step} in {path}; it holds "
                              f"{sorted(manager.all_steps())}.")
    return manager.restore(step, args=ocp.args.StandardRestore(state))


def seeded(task: TaskT, config) -> TaskT:
  """`task` for `config`, a config of the same run but another seed, reusing its compiled steps.

  The jitted steps of a classification or maze task depend on everything in the
  config but the seed; of the seed the task itself reads only the data order
  (config.seed in its train batches), while train.run draws the init and
  sampling rng from config.seed.
  """
  task = copy.copy(task)
  task.config = config
  return task


def refuse_other_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Stops the figure (one line) when `workdir` holds a run of a config other than `config`:
  a cached run is reused, or resumed, only under the config it was made with."""
  try:
    train.check_same_run(config, workdir)
  except ValueError as error:
    raise SystemExit(f"error: {error}") from None


class TrainedRun(NamedTuple):
  """A figure's run: its metric rows, and the step whose update went non-finite (no row from
  it on), None when it trained to the end."""
  rows: list[dict]
  stopped_at: int | None


def nan_scores(ks: Sequence[int]) -> dict[str, float]:
  """The last row of a run that went non-finite: NaN held-out and validation pass@k, a result
  that is reported as it is and never chosen."""
  return {f"{prefix}pass@{k}": np.nan for prefix in ("", "validation/") for k in ks}


def _done(config: ml_collections.ConfigDict, workdir: str) -> TrainedRun | None:
  """The run in `workdir` when it is done (`sweep.is_done`: finished, or stopped by its
  batch); else None."""
  if not sweep.is_done(workdir, config.num_steps):
    return None
  outcome = batched.run_outcome(workdir)
  return TrainedRun(train.read_metrics(workdir), outcome.stopped_at if outcome else None)


def train_or_read_batch(configs: Sequence[ml_collections.ConfigDict], workdirs: Sequence[str],
                        labels: Sequence[str], *, one_by_one: bool = False) -> list[TrainedRun]:
  """The runs of `configs` (alike but in the keys a batch may vary) in `workdirs`: read back
  when done earlier, the others trained (or resumed) as one program (`batched.run_batch`,
  docs/training.md#sweeps-sera-jax-sweep), or each as a batch of its own with `one_by_one`
  (on a CPU the faster way for runs whose steps are memory-bound, docs/benchmarks.md). A
  workdir holding a run of another config stops the figure (`refuse_other_config`)."""
  start = time.perf_counter()
  runs = []
  for config, workdir, label in zip(configs, workdirs, labels, strict=True):
    refuse_other_config(config, workdir)
    runs.append(_done(config, workdir))
    if runs[-1] is not None:
      print(f"{label}: finished earlier, read {workdir}", flush=True)
  todo = [r for r, run in enumerate(runs) if run is None]
  for group in ([[r] for r in todo] if one_by_one else [todo] if todo else []):
    try:
      rows = batched.run_batch([configs[r] for r in group], [workdirs[r] for r in group])
    except ValueError as error:  # e.g. a workdir holding part of a run of no batch
      raise SystemExit(f"error: {error}") from None
    for r, run_rows in zip(group, rows, strict=True):
      runs[r] = TrainedRun(run_rows, batched.run_outcome(workdirs[r]).stopped_at)
    print(f"{'; '.join(labels[r] for r in group)}: {'alone' if one_by_one else 'one batch'}, "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    start = time.perf_counter()
  return runs



# ----------------------------------------------------------------------------- learning rates


def with_validation_split(config: ml_collections.ConfigDict, num_validation: int
                          ) -> ml_collections.ConfigDict:
  """`config` whose dataset sets `num_validation` examples aside as a validation split, which
  every evaluation then also scores ("validation/pass@k")."""
  with config.unlocked():
    config.dataset_kwargs.num_validation = num_validation
  return config


def choose_rate(scores: Mapping[float, float]) -> float:
  """The rate of the best validation score (ties: the smaller rate; NaN never wins)."""
  return max(sorted(scores), key=lambda rate: -np.inf if np.isnan(scores[rate]) else scores[rate])


# The first seed that chooses a figure's learning rates (the math figure's config.tuning_seeds
# start here too), apart from the seeds a figure reports: a run's validation and held-out
# scores share its luck, so the run that won the choice would report a held-out score biased
# upward (the winner's curse), where a reported seed's run at the chosen rate is independent
# of the choice.
TUNING_SEED = 100


def tuning_seeds(count: int) -> list[int]:
  """The first `count` tuning seeds: TUNING_SEED, TUNING_SEED + 1, ..."""
  return list(range(TUNING_SEED, TUNING_SEED + count))


def check_reported_seeds(parser: argparse.ArgumentParser, seeds: Sequence[int],
                         tuning: Sequence[int]) -> None:
  """Refuses (parser.error) reported seeds that repeat or that tune."""
  if len(set(seeds)) != len(seeds) or min(seeds) < 0:
    parser.error("--seeds must be distinct and >= 0")
  shared = sorted(set(seeds) & set(tuning))
  if shared:
    parser.error(f"--seeds {shared} are among the tuning seeds {list(tuning)}, which choose "
                 f"the rates and are not reported: report other seeds")


class TunedRuns(NamedTuple):
  """A learning rate chosen on validation, and the runs behind it."""
  rate: float  # the chosen rate
  scores: dict[float, float]  # {rate: mean validation score over the tuning seeds}
  grid: dict[float, dict[int, Any]]  # {rate: {tuning seed: its run}}
  runs: dict[int, Any]  # {reported seed: its run at the chosen rate}


def tune_then_repeat(train_grid, rates: Sequence[float], seeds: Sequence[int], validation_score,
                     *, tuning_seeds: Sequence[int]) -> TunedRuns:
  """Trains `tuning_seeds` at every rate, chooses the rate of the best mean
  `validation_score(run)` over them, then trains the reported `seeds` at it.

  The tuning seeds are not reported (see `TUNING_SEED`): only the validation split chose the
  rate, but a tuning run's held-out score shares the luck that won it the choice.

  Args:
    train_grid: [(rate, seed), ...] -> [its run, ...] in that order (whatever the figure keeps
      of a run): called twice, for the whole tuning grid and for the reported seeds, so that
      each can train as one batch.
    rates: the grid.
    seeds: the reported seeds.
    validation_score: run -> its score on the validation split (NaN: unusable, e.g. diverged;
      a rate with one such run is never chosen).
    tuning_seeds: the seeds that choose the rate (`tuning_seeds()`), none of them reported.
  """
  tuning = list(tuning_seeds)
  if not tuning:
    raise ValueError("tuning_seeds must hold at least one seed.")
  shared = sorted(set(tuning) & set(seeds))
  if shared:
    raise ValueError(f"seeds {shared} both tune and are reported; a tuning run's held-out "
                     f"score is biased by the choice it won.")
  points = [(rate, seed) for rate in rates for seed in tuning]
  trained = dict(zip(points, train_grid(points), strict=True))
  grid = {rate: {seed: trained[rate, seed] for seed in tuning} for rate in rates}
  scores = {rate: float(np.mean([validation_score(run) for run in per_seed.values()]))
            for rate, per_seed in grid.items()}
  rate = choose_rate(scores)
  reported = [(rate, seed) for seed in seeds]
  runs = dict(zip(seeds, train_grid(reported), strict=True))
  return TunedRuns(rate, scores, grid, runs)


def grid_runs(tuned: TunedRuns) -> list[tuple[tuple[float, int], Any]]:
  """[((rate, tuning seed), run)] over the whole grid, by rate then seed."""
  return [((rate, seed), run) for rate, per_seed in sorted(tuned.grid.items())
          for seed, run in sorted(per_seed.items())]


def print_choice(label: str, metric: str, tuned: TunedRuns) -> None:
  """One line: the validation score of every rate and the chosen one."""
  print(f"{label}: validation {metric} " + ", ".join(
      f"{rate:g} -> {score:.4f}" for rate, score in sorted(tuned.scores.items()))
        + f"; chosen {tuned.rate:g}", flush=True)


def plot_rate_sensitivity(axis, tuned: TunedRuns, *, label: str, **style) -> None:
  """One method's validation score against the rate (log x), its chosen rate starred."""
  rates = sorted(tuned.scores)
  line, = axis.plot(rates, [tuned.scores[r] for r in rates], marker="o", label=label, **style)
  axis.plot([tuned.rate], [tuned.scores[tuned.rate]], marker="*", markersize=14,
            color=line.get_color())
  axis.set_xscale("log")
  axis.set_xlabel("learning rate")
  axis.grid(alpha=0.3)


def with_settings(config: ml_collections.ConfigDict, **settings) -> ml_collections.ConfigDict:
  """A copy of `config` with `settings` (a run's method, seed, rate, evaluation sets)."""
  config = config.copy_and_resolve_references()
  config.update(settings)
  return config


def method_run_dir(workdir, method: str, rate: float, seed: int) -> str:
  """The workdir of `tune_methods`'s run of `method` at `rate` and `seed`."""
  return os.fspath(files.path(workdir) / f"{method}-lr{rate:g}-seed{seed}")


def tune_methods(config: ml_collections.ConfigDict, methods: Sequence[str], seeds: Sequence[int],
                 learning_rates: Sequence[float], tuning_seeds: Sequence[int], workdir,
                 figure_run: "FigureRun", *, chosen_by: int, one_by_one: bool = False
                 ) -> dict[str, TunedRuns]:
  """{method: its runs (the last metric row of each) at the rate chosen on validation} for a
  setting whose evaluation scores "validation/pass@k" and "pass@k" (the maze's, the
  simulation's): each method's tuning grid trains as one batch, scored on the validation
  set (its rate: the best mean validation pass@`chosen_by` over `tuning_seeds`), then its
  reported seeds as another, scored on the held-out set; run workdirs under `workdir`."""
  chosen = f"validation/pass@{chosen_by}"
  tuned = {}
  for method in methods:

    def train_grid(points, method=method):
      tuning = points[0][1] in tuning_seeds
      runs = [with_settings(config, method=method, seed=seed, learning_rate=rate,
                            eval_sets=("validation",) if tuning else ("held_out",))
              for rate, seed in points]
      labels = [f"{method} lr {rate:g} seed {seed}" for rate, seed in points]
      trained = train_or_read_batch(
          runs, [method_run_dir(workdir, method, rate, seed) for rate, seed in points], labels,
          one_by_one=one_by_one)
      metric = chosen if tuning else "pass@1"
      lasts = []
      for label, run in zip(labels, trained, strict=True):
        if run.stopped_at is not None:
          print(f"{label}: went non-finite at step {run.stopped_at}", flush=True)
          lasts.append({})
          continue
        lasts.append([row for row in run.rows if metric in row][-1])
        print(f"{label}: {metric} {lasts[-1][metric]:.3f} ({figure_run.elapsed():.0f} s)",
              flush=True)
      return lasts

    tuned[method] = tune_then_repeat(train_grid, learning_rates, seeds,
                                     lambda row: row.get(chosen, np.nan),
                                     tuning_seeds=tuning_seeds)
    print_choice(method, f"pass@{chosen_by}", tuned[method])
  return tuned


def write_validation_grid_csv(tuned: Mapping[str, TunedRuns], ks: Sequence[int], path: str
                              ) -> None:
  """Every tuning run of `tune_methods`: its validation pass@k (NaN: it went non-finite)."""
  files.write_csv(path, [
      {"method": method, "learning_rate": rate, "seed": seed, "chosen": rate == runs.rate,
       **{f"validation_pass@{k}": f"{row.get(f'validation/pass@{k}', np.nan):.4f}" for k in ks}}
      for method, runs in tuned.items() for (rate, seed), row in grid_runs(runs)])


def plot_validation_grid(tuned: Mapping[str, TunedRuns], path: str, *, ylabel: str, title: str
                         ) -> None:
  """Each method's validation score against its rate (`plot_rate_sensitivity`)."""
  fig, axis = plt.subplots(figsize=(5, 3.8))
  for method, runs in tuned.items():
    plot_rate_sensitivity(axis, runs, label=method)
  axis.set(ylabel=ylabel, title=title)
  axis.legend(fontsize=8)
  fig.tight_layout()
  save_figure(fig, path, dpi=120)


class EvalBatch(NamedTuple):
  """Fixed training prompts: ids into the training set, images and labels."""
  ids: np.ndarray
  images: np.ndarray
  labels: np.ndarray


def evaluation_batches(dataset, batch_size: int, num_batches: int, seed: int = 0
                       ) -> list[EvalBatch]:
  """`num_batches` disjoint fixed batches of training prompts (an in-memory dataset)."""
  if not hasattr(dataset, "train_images"):
    raise ValueError(f"the figure scripts need an in-memory dataset (digits, synthetic); "
                     f"{dataset.name!r} is streamed.")
  if batch_size * num_batches > dataset.num_train:
    raise ValueError(f"{num_batches} batches of {batch_size} exceed the {dataset.num_train} "
                     f"training examples.")
  order = np.random.default_rng(seed).permutation(dataset.num_train)
  batches = []
  for i in range(num_batches):
    ids = order[i * batch_size:(i + 1) * batch_size]
    batches.append(EvalBatch(ids, dataset.train_images[ids], dataset.train_labels[ids]))
  return batches


def forward_logits(task: ClassificationTask, state: TrainState, images) -> jax.Array:
  """Training-mode logits, as in the training step."""
  logits, _ = task.model.apply(state.params, state.batch_stats, images, train=True)
  return logits


def figure_parser(name: str, description: str) -> argparse.ArgumentParser:
  """The parser of `sera-jax figure NAME`, with the `--out DIR` every figure takes."""
  parser = argparse.ArgumentParser(prog=f"sera-jax figure {name}",
                                   description=description.split("\n\n")[0])
  parser.add_argument("--out", default=OUT_DIR,
                      help=f"directory of the figure's PNG and CSV (default {OUT_DIR})")
  return parser


def add_method_grid(parser: argparse.ArgumentParser, learning_rates: Sequence[float]) -> None:
  """The arguments of a figure that tunes each method's rate (`tune_methods`): --tiny,
  --seeds, --tuning-seeds, --learning-rates, --methods and --one-by-one."""
  parser.add_argument("--tiny", action="store_true", help="a small smoke run")
  parser.add_argument("--seeds", type=int, default=10, help="seeds 0, 1, ..., SEEDS-1")
  parser.add_argument("--tuning-seeds", type=int, default=2,
                      help="how many tuning seeds (100, 101, ...; never reported) train at "
                      "every rate (default 2)")
  parser.add_argument("--learning-rates", nargs="+", type=float, default=list(learning_rates),
                      help="the grid each method chooses its rate from")
  parser.add_argument("--methods", nargs="+", default=["sera", "uniform", "grpo"])
  add_one_by_one(parser)


def method_grid_seeds(parser: argparse.ArgumentParser, args: argparse.Namespace
                      ) -> tuple[list[int], list[int]]:
  """(reported seeds, tuning seeds) of `add_method_grid`'s arguments, which it checks."""
  if args.tuning_seeds < 1:
    parser.error("--tuning-seeds must be >= 1")
  tuning = tuning_seeds(args.tuning_seeds)
  seeds = list(range(args.seeds))
  check_reported_seeds(parser, seeds, tuning)
  if not all(rate > 0 for rate in args.learning_rates):
    parser.error("every learning rate must be > 0")
  return seeds, tuning


def add_one_by_one(parser: argparse.ArgumentParser) -> None:
  """--one-by-one: a figure that trains grids trains every run as a batch of its own."""
  parser.add_argument("--one-by-one", action="store_true",
                      help="train every run by itself instead of each grid as one batch")


def output_paths(out: str, stem: str) -> tuple[str, str]:
  """(PNG, CSV) paths of the figure `stem` in the directory `out` (local or a URL)."""
  out = files.path(out)
  return os.fspath(out / f"{stem}.png"), os.fspath(out / f"{stem}.csv")


def add_run_arguments(parser: argparse.ArgumentParser, *, seeds: int | None) -> None:
  """The arguments of the snapshot run the figures evaluate, and the seeds (if any)."""
  parser.add_argument("--config", default=configs.DEFAULT,
                      help=configs.help_text() + "; a classification config, whose run's "
                      "snapshots are evaluated")
  parser.add_argument("--method", default="ce", choices=("ce", "sera", "uniform", "equalized"),
                      help="update rule of that run (default ce: the exact gradient, a "
                      "trajectory that favours none of the compared estimators)")
  parser.add_argument("--num-steps", type=int, help="override config.num_steps")
  parser.add_argument("--batch-size", type=int, help="override config.batch_size (M)")
  parser.add_argument("--workdir", help="training run directory (default runs/figures-...)")
  if seeds is not None:
    parser.add_argument("--seeds", type=int, default=seeds, help="sampling seeds per point")


def prepare_run(args: argparse.Namespace) -> tuple[ClassificationTask, str, dict[str, int]]:
  """Loads the config, trains (or resumes) the run and returns (task, workdir, snapshots)."""
  try:
    config = configs.load(args.config)
  except FileNotFoundError as error:
    raise SystemExit(f"error: {error}") from None
  if config.get("task") != "classification":
    raise SystemExit(f"error: --config {args.config}: this figure evaluates a run of the "
                     f"classification setting; the config's task is {config.get('task')!r}.")
  config.method = args.method
  config.align_every = 10  # the run's own alignment.png; the figures measure their own
  if args.num_steps is not None:
    config.num_steps = args.num_steps
  if args.batch_size is not None:
    config.batch_size = args.batch_size
  workdir = args.workdir or os.path.join(
      "runs", f"figures-{pathlib.Path(args.config).stem}-{config.method}-{config.num_steps}steps"
      f"-m{config.batch_size}")
  try:
    task = ClassificationTask(config)
    # Checked before training: a run shorter than an epoch has no snapshot to evaluate.
    steps = snapshot_steps(config.num_steps, task.dataset.steps_per_epoch(config.batch_size))
    train_for_snapshots(config, workdir, task)
  except ValueError as error:  # e.g. the workdir holds a run of another config
    raise SystemExit(f"error: {error}") from None
  return task, workdir, steps


# ----------------------------------------------------------------------------- historical p


def historical_log_p(task: ClassificationTask, workdir: str, steps: Sequence[int], *,
                     seed: int = 0) -> dict[int, jax.Array]:
  """The frozen historical estimates of every training prompt at epoch boundaries.

  The estimates are those of docs/method.md#estimating-p.

  Replays the epochs before max(steps) over the whole training set once:
  epoch e rolls out every training prompt with the policy of the checkpoint
  at its start, allocated by `allocations.historical_allocation` in mode "sera"
  (budget num_train * N0: epoch 0 uniform, as nothing is seen yet, later epochs
  SERA on the frozen estimate), stages the outcomes and folds them in at the
  boundary with the config's estimator (discount, prior). Within-epoch policy
  drift is ignored (the epoch's first policy plays the whole epoch).

  Returns:
    {step: log_p [num_train]} for each step of `steps`, indexed by training-set id.
  """
  config = task.config
  dataset = task.dataset
  steps_per_epoch = dataset.steps_per_epoch(config.batch_size)
  if any(step % steps_per_epoch or step <= 0 for step in steps):
    raise ValueError(f"steps {list(steps)} must be positive epoch boundaries "
                     f"(epochs of {steps_per_epoch} steps).")
  all_ids = jnp.arange(dataset.num_train)
  images, labels = jnp.asarray(dataset.train_images), jnp.asarray(dataset.train_labels)

  sera = allocations.allocation_config(config, "sera")
  prior = dict(alpha0=sera.alpha0, beta0=sera.beta0)

  @jax.jit
  def replay_epoch(history, state, key):
    logits = forward_logits(task, state, images)
    history, alloc, _ = allocations.historical_allocation(sera, history, all_ids, False, True,
                                                          logits, labels, key)
    rollouts = gradients.sample_rollouts(key, logits, labels, alloc.counts,
                                         max_rollouts=config.n_max)
    history = success.historical_stage(history, all_ids, rollouts.rewards, rollouts.mask)
    return success.historical_start_epoch(history, discount=sera.discount)

  history = success.historical_init(dataset.num_train)
  estimates = {}
  for epoch in range(max(steps) // steps_per_epoch):
    state = load_state(task, workdir, epoch * steps_per_epoch)
    key = jax.random.fold_in(jax.random.PRNGKey(seed), epoch)
    history = replay_epoch(history, state, key)
    if (epoch + 1) * steps_per_epoch in steps:
      estimates[(epoch + 1) * steps_per_epoch] = success.historical_estimate(
          history, all_ids, **prior)[0]
  return estimates


# ----------------------------------------------------------------------------- reporting


def mean_interval(values: np.ndarray, axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
  """Mean and half-width of its 95% Student-t interval along `axis`."""
  values = np.asarray(values, dtype=np.float64)
  count = values.shape[axis]
  if count < 2:
    return values.mean(axis), np.zeros_like(values.mean(axis))
  half = stats.t.ppf(0.975, count - 1) * values.std(axis, ddof=1) / np.sqrt(count)
  return values.mean(axis), half


def per_seed_rows(columns: Mapping[str, Any], values, seeds: Sequence[int], ks: Sequence[int],
                  *, digits: int) -> list[dict[str, Any]]:
  """One row per k: `columns`, k, the mean, std and 95% interval over seeds, each seed's value.

  Args:
    columns: the leading columns shared by the rows (e.g. {"method": "sera"}).
    values: [S, K] one value per seed and k.
    seeds: the S seeds (column names seed<s>).
    ks: the K values of k.
    digits: decimals written.
  """
  values = np.asarray(values)
  means, halves = mean_interval(values, axis=0)
  number = lambda v: f"{v:.{digits}f}"  # noqa: E731
  return [{**columns, "k": k, "mean": number(mean), "std": number(column.std()),
           "ci95": number(half), **{f"seed{s}": number(v) for s, v in zip(seeds, column,
                                                                          strict=True)}}
          for k, column, mean, half in zip(ks, values.T, means, halves, strict=True)]


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A fixed-width text table (floats with 4 decimals)."""
  cells = [[f"{v:.4f}" if isinstance(v, float) else str(v) for v in row] for row in rows]
  widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
  line = lambda row: "  ".join(str(v).rjust(w) for v, w in zip(row, widths, strict=True))  # noqa: E731
  return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, cells)])


# ----------------------------------------------------------------------------- pass@k figures


DIFFERENCE = " - "  # joins a method and its baseline in the name of their paired difference


def paired_differences(results: Mapping[str, Mapping[int, Sequence[float]]], seeds: Sequence[int],
                       *, baseline: str = "uniform", exclude: Sequence[str] = ()
                       ) -> dict[str, np.ndarray]:
  """{"M - baseline": [S, K] per-seed differences} for every method M but the baseline and
  `exclude` (references such as the warm start): the comparison paired by seed."""
  if baseline not in results:
    return {}
  reference = np.array([results[baseline][s] for s in seeds])
  return {f"{method}{DIFFERENCE}{baseline}": np.array([per_seed[s] for s in seeds]) - reference
          for method, per_seed in results.items() if method not in (baseline, *exclude)}


def write_pass_at_k_csv(results, seeds: Sequence[int], ks: Sequence[int], path: str, *,
                        exclude: Sequence[str] = ()) -> None:
  """Every method's pass@k per seed and k, then the paired differences to uniform."""
  rows = [row for method, per_seed in results.items()
          for row in per_seed_rows({"method": method}, [per_seed[s] for s in seeds], seeds, ks,
                                   digits=4)]
  rows += [row for name, values in paired_differences(results, seeds, exclude=exclude).items()
           for row in per_seed_rows({"method": name}, values, seeds, ks, digits=4)]
  files.write_csv(path, rows)


def read_pass_at_k_csv(path: str) -> tuple[dict[str, dict[int, list[float]]], list[int], list[int]]:
  """The (results, seeds, ks) that `write_pass_at_k_csv` wrote to `path`, its paired
  differences left out (they follow from the results): a figure's methods trained in
  separate processes or on separate machines combine by reading each one's CSV back."""
  rows = [row for row in files.read_csv(path) if DIFFERENCE not in row["method"]]
  if not rows:
    raise ValueError(f"{path} holds no method's pass@k.")
  seeds = [int(column.removeprefix("seed")) for column in rows[0] if column.startswith("seed")]
  ks = list(dict.fromkeys(int(row["k"]) for row in rows))
  results: dict[str, dict[int, list[float]]] = {}
  for row in rows:
    per_seed = results.setdefault(row["method"], {seed: [] for seed in seeds})
    for seed in seeds:
      per_seed[seed].append(float(row[f"seed{seed}"]))
  return results, seeds, ks


def plot_pass_at_k(results, seeds: Sequence[int], ks: Sequence[int], path: str, *, title: str,
                   what: str, styles: Mapping[str, Mapping[str, Any]] | None = None,
                   exclude: Sequence[str] = ()) -> None:
  """Left: pass@k (mean ± std over seeds) per method; right, when uniform and another
  method are in `results`: the paired differences to uniform with their 95% intervals.
  `what` names the evaluation set."""
  differences = paired_differences(results, seeds, exclude=exclude)
  panels = 1 + bool(differences)
  fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
  left = axes[0, 0]
  for method, per_seed in results.items():
    values = np.array([per_seed[s] for s in seeds])
    left.errorbar(ks, values.mean(0), yerr=values.std(0), marker="o", capsize=3, label=method,
                  **(styles or {}).get(method, {}))
  left.set(ylabel=f"pass@k ({what}, mean ± std)")
  if differences:
    right = axes[0, 1]
    for name, diff in differences.items():
      mean, half = mean_interval(diff, axis=0)
      right.errorbar(ks, mean, yerr=half, marker="o", capsize=3, label=name)
    right.axhline(0.0, color="black", linewidth=0.8)
    right.set(ylabel="pass@k difference, paired by seed (95% CI)")
  for axis in axes[0]:
    axis.set_xscale("log", base=2)
    axis.set_xlabel("k")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
  fig.suptitle(textwrap.fill(title, 75 * panels), fontsize=9)  # a long one is clipped
  fig.tight_layout()
  save_figure(fig, path, dpi=120)


def pass_at_k_tables(results, seeds: Sequence[int], ks: Sequence[int], *,
                     exclude: Sequence[str] = ()) -> str:
  """Markdown tables: pass@k mean ± std per method, then the paired differences to uniform
  (mean ± 95% interval half-width) when there are any."""
  def table(rows, number):
    lines = [f"| | {' | '.join(f'pass@{k}' for k in ks)} |", f"|---|{'---|' * len(ks)}"]
    for name, (centre, spread) in rows.items():
      cells = " | ".join(f"{number.format(c)} ± {h:.3f}"
                         for c, h in zip(centre, spread, strict=True))
      lines.append(f"| {name} | {cells} |")
    return "\n".join(lines)

  spread = {method: (np.mean(v := np.array([per_seed[s] for s in seeds]), 0), np.std(v, 0))
            for method, per_seed in results.items()}
  paired = {name: mean_interval(diff, axis=0)
            for name, diff in paired_differences(results, seeds, exclude=exclude).items()}
  if not paired:
    return table(spread, "{:.3f}")
  return (table(spread, "{:.3f}") + "\n\npaired by seed, mean and 95% interval:\n"
          + table(paired, "{:+.3f}"))


def seeds_ahead(results, seeds: Sequence[int], ks: Sequence[int], method: str,
                baseline: str = "uniform", tolerance: float = 0.005) -> str:
  """One line: at each k, in how many seeds `method` is ahead of `baseline`, behind it, and
  level with it (within `tolerance`)."""
  diff = np.array([results[method][s] for s in seeds]) - np.array(
      [results[baseline][s] for s in seeds])
  counts = [f"pass@{k} {np.sum(d > tolerance)}/{np.sum(d < -tolerance)}/"
            f"{np.sum(np.abs(d) <= tolerance)}" for k, d in zip(ks, diff.T, strict=True)]
  return f"{method} against {baseline}, seeds ahead/behind/level: " + ", ".join(counts)


def _git(*args: str) -> str:
  try:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                          cwd=pathlib.Path(__file__).parent).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return ""


def _version(distribution: str) -> str:
  try:
    return metadata.version(distribution)
  except metadata.PackageNotFoundError:  # a source tree that was never installed
    return "0+unknown"


MANIFEST_SUFFIX = ".manifest.json"


def manifest_path(out: str, name: str):
  """Where the figure `name` (its CSV's stem) keeps its manifest in `out`."""
  return files.path(out) / f"{name}{MANIFEST_SUFFIX}"


class FigureRun(NamedTuple):
  """When a figure command started and the code it started from: its manifest records the
  commit the figure was made at, not the one checked out when it is written hours later."""
  started: float  # time.time()
  git_commit: str
  uncommitted_changes: bool

  def elapsed(self) -> float:
    return time.time() - self.started


def start_figure() -> FigureRun:
  """Called first by a figure command: the clock and the code state for its manifest."""
  return FigureRun(time.time(), _git("rev-parse", "HEAD"),
                   bool(_git("status", "--porcelain", "--untracked-files=no")))


def write_manifest(out: str, name: str, run: FigureRun, *, command: str, argv: Sequence[str],
                   seeds: Sequence[int], tuning_seeds: Sequence[int],
                   protocol: Mapping[str, Any]) -> str:
  """Writes `out`/`name`.manifest.json beside the figure's CSV: how it was made (the command
  `sera-jax COMMAND ARGV`, COMMAND e.g. "figure outcome"; the package version and the git
  commit `run` started from with a flag for uncommitted changes; the jax and flax versions,
  the device, the reported and tuning seeds, the wall time since `run` started and the
  figure's protocol facts).
  Returns its path."""
  manifest = {
      "command": " ".join(["sera-jax", command, *argv]),
      "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
      "sera_jax_version": _version("sera_jax"),
      "git_commit": run.git_commit,
      "uncommitted_changes": run.uncommitted_changes,
      "jax_version": jax.__version__,
      "flax_version": _version("flax"),
      "device": f"{jax.devices()[0].platform}: {jax.devices()[0].device_kind} x "
                f"{jax.device_count()}",
      "seeds": list(seeds),
      "tuning_seeds": list(tuning_seeds),
      "wall_time_s": round(run.elapsed(), 1),
      "protocol": dict(protocol),
  }
  path = manifest_path(out, name)
  files.write_text(path, json.dumps(manifest, indent=2) + "\n")
  return os.fspath(path)


def rate_choices(tuned: Mapping[Any, TunedRuns]) -> dict[str, dict]:
  """The manifest's record of each choice of a learning rate: {key ("/"-joined when a
  tuple): {"chosen": rate, "validation": {rate: mean validation score}}}."""
  return {"/".join(map(str, key)) if isinstance(key, tuple) else str(key): {
      "chosen": runs.rate,
      "validation": {f"{rate:g}": float(score) for rate, score in sorted(runs.scores.items())}}
      for key, runs in tuned.items()}


def read_manifest(out: str, name: str) -> dict | None:
  """The manifest of the figure `name` in `out`, None when it has none."""
  path = manifest_path(out, name)
  return json.loads(path.read_text()) if path.exists() else None


def snapshot_protocol(args: argparse.Namespace, task: ClassificationTask,
                      snapshots: Mapping[str, int], **facts) -> dict:
  """The protocol facts of a figure evaluated at snapshots of one run (`prepare_run`'s), and
  `facts`."""
  config = task.config
  return {"config": args.config, "dataset": config.dataset, "model": config.model,
          "run_method": config.method, "run_steps": config.num_steps,
          "batch_size": config.batch_size, "baseline_n": config.baseline_n,
          "snapshots": dict(snapshots), **facts}
