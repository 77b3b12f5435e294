"""The training loop: one task, checkpoints, metric writers, resume.

A task (classification as RL, maze navigation) is an object with

  init_state(rng) -> state            a pytree of arrays: everything to resume
  train_step(state, step) -> (state, metrics)
  evaluate(state) -> dict             held-out metrics, every config.eval_every
  write_figures(workdir, rows)        figures drawn from the metric rows

`run` drives it: it restores the latest Orbax checkpoint of the workdir if
there is one, runs to config.num_steps, writes one JSON object per step to
metrics/ (`read_metrics` reads them back) and to TensorBoard, saves checkpoints every
config.checkpoint_every steps and stops on non-finite metrics or a non-finite
new state (parameters, optimizer state: any floating leaf), before that state
can be saved, keeping the last good checkpoint. Batches and RNG depend only on
the step number (data position = step, RNG = fold_in(rng, step)), so a run
killed at any point and resumed writes exactly the metrics of an uninterrupted
run.

Every file goes through `sera_jax.common.files` (etils.epath), so the workdir
may be a bucket URL (gs://...) as well as a local path; Orbax gets it unchanged.
"""

import contextlib
import importlib
import json
import logging
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import tqdm
from etils import epath
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.scalar import summary_v2 as scalar_summary
from tensorboard.summary.writer import record_writer

from sera_jax.common import files
from sera_jax.method import validation

METRICS_DIR = "metrics"
# Where runs of earlier versions kept their rows in one file; read before metrics/.
LEGACY_METRICS_FILE = "metrics.jsonl"
METRICS_PART = re.compile(r"(\d+)-(\d+)\.jsonl")  # metrics/<leg>-<part>.jsonl
CONFIG_FILE = "config.json"
CHECKPOINT_DIR = "checkpoints"
# In the workdir of a run of a batch (sera_jax.harness.batched): the batch directory, whose
# checkpoints hold the run's state.
BATCH_MARK = "batch.json"
# The settings the loop trains: config.task -> (their module, its task's class).
SETTINGS = {"classification": ("sera_jax.settings.classification.task", "ClassificationTask"),
            "maze": ("sera_jax.settings.maze.task", "MazeTask"),
            "sim": ("sera_jax.settings.sim.task", "SimTask")}
TENSORBOARD_DIR = "tensorboard"
PROFILE_DIR = "profile"
PROGRESS_KEYS = ("cos/sera_expected", "cos/uniform_expected", "loss", "accuracy", "pass@1")
FLUSH_SECONDS = 10.0


class Task(Protocol):
  def init_state(self, rng: jax.Array) -> Any: ...
  def train_step(self, state: Any, step: int) -> tuple[Any, Mapping[str, jax.Array]]: ...
  def evaluate(self, state: Any) -> dict[str, float]: ...
  def write_figures(self, workdir: str, rows: list[dict]) -> None: ...


class TensorBoardWriter:
  """Scalars in one TensorBoard event file, written through epath (so a bucket URL works).

  The records are TensorBoard's own (its record writer and scalar summaries, the
  format tf.summary writes); each flush uploads the file whole on an object store. The file
  opens with a session start at `start_step`: TensorBoard takes every start after a run's
  first as a restart and drops the earlier files' events from that step on, so the steps a
  resumed leg redoes are shown once, as `read_metrics` reads them.
  """

  def __init__(self, logdir: epath.PathLike, start_step: int = 0):
    logdir = files.path(logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    name = f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}.{os.getpid()}.v2"
    self._records = record_writer.RecordWriter((logdir / name).open("wb"))
    self._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
    self._write(event_pb2.Event(wall_time=time.time(), step=start_step,
                                session_log=event_pb2.SessionLog(
                                    status=event_pb2.SessionLog.START)))

  def _write(self, event: event_pb2.Event) -> None:
    self._records.write(event.SerializeToString())

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    summary = summary_pb2.Summary(value=[value for name, number in scalars.items()
                                         for value in scalar_summary.scalar_pb(name, number).value])
    self._write(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

  def flush(self) -> None:
    self._records.flush()

  def close(self) -> None:
    self._records.close()


def _metric_parts(directory: epath.Path) -> list[tuple[int, int, epath.Path]]:
  """(leg, part, file) of every part in `directory`/metrics, in the order they were written."""
  folder = directory / METRICS_DIR
  if not folder.exists():
    return []
  found = [(match, path) for path in folder.iterdir()
           if (match := METRICS_PART.fullmatch(path.name))]
  return sorted((int(match[1]), int(match[2]), path) for match, path in found)


class MetricLog:
  """The writing process's metrics: parts of metrics/ (one JSON object a line) and TensorBoard.

  Nothing stored is ever rewritten or truncated, so a kill at any moment loses only rows
  not yet flushed: steps after the last checkpoint, which the resumed run redoes. Each leg
  of a run (its start, every resume) writes parts after the earlier legs' ones, and
  `read_metrics` lets a leg's rows replace the earlier rows of their steps and later ones.
  A local part is a file the leg keeps appending to; an object store has no append (an
  object is uploaded whole), so on a bucket every flush closes its part, uploading the rows
  since the previous flush once, and the next rows start a new part. Flushes happen before
  every checkpoint (so a checkpoint's rows are stored first) and at least every
  FLUSH_SECONDS. TensorBoard gets one event file a leg, stored whole at each flush, which
  replaces the earlier legs' events from `start_step` (the step the leg resumes at) on.
  """

  def __init__(self, workdir: epath.PathLike, start_step: int = 0):
    workdir = files.path(workdir)
    self._folder = workdir / METRICS_DIR
    self._folder.mkdir(parents=True, exist_ok=True)
    self._leg = 1 + max((leg for leg, _, _ in _metric_parts(workdir)), default=-1)
    self._part, self._file = 0, None
    self._part_per_flush = files.is_url(workdir)
    self._events = TensorBoardWriter(workdir / TENSORBOARD_DIR, start_step)
    self.flush()

  def write(self, row: dict) -> None:
    if self._file is None:  # opened at the first row: a leg without rows leaves no part
      self._file = (self._folder / f"{self._leg:04d}-{self._part:06d}.jsonl").open("w")
    self._file.write(json.dumps(row) + "\n")
    self._events.write(row["step"], {name: value for name, value in row.items() if name != "step"})
    if time.monotonic() - self._flushed > FLUSH_SECONDS:
      self.flush()

  def flush(self) -> None:
    if self._file is not None and self._part_per_flush:
      self._file.close()
      self._file, self._part = None, self._part + 1
    elif self._file is not None:
      self._file.flush()
    self._events.flush()
    self._flushed = time.monotonic()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
    self._events.close()


class Profile:
  """A jax.profiler trace of the steps `steps`, stored in `destination` when it stops.

  The profiler writes local files; they are copied through epath, so a bucket
  workdir receives them too. A resumed run traces the rest of the window.
  """

  def __init__(self, steps: range, destination: epath.PathLike):
    self._steps, self._destination, self._local = steps, destination, None

  def before(self, step: int) -> None:
    if step in self._steps and self._local is None:
      self._local = tempfile.mkdtemp(prefix="sera_jax_profile_")
      jax.profiler.start_trace(self._local)

  def after(self, step: int, state: Any) -> None:
    if self._local is not None and step == self._steps.stop - 1:
      jax.block_until_ready(state)
      self.stop()

  def stop(self) -> None:
    if self._local is not None:
      local, self._local = self._local, None
      jax.profiler.stop_trace()
      files.copy_tree(local, self._destination)
      shutil.rmtree(local)


class NonFiniteError(FloatingPointError):
  """Raised when a step produced NaN or inf; the last good checkpoint is kept.

  Attributes:
    step: the step that produced them (its metrics row is not written).
  """

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step


class CheckpointError(RuntimeError):
  """Raised when the checkpoint a run would resume from cannot be restored.

  The workdir is left as it was; the message names the step, its path and how to go on.
  """


def _from_orbax(exc_info) -> bool:
  return bool(exc_info) and "orbax" in "".join(traceback.format_exception(*exc_info))


def _quiet_abandoned_reads() -> None:
  """Drops the tracebacks of Orbax's abandoned array reads, and only those.

  After one read of a restore fails, Orbax's other pending reads fail too when
  they are garbage-collected (which ones, and when, depends on thread timing):
  each would print its TensorStore failure as an "Exception ignored in
  <coroutine ...>" or an asyncio "Task exception was never retrieved" traceback
  around the one-line error.
  """
  previous = sys.unraisablehook

  def hook(unraisable):
    if not _from_orbax((unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback)):
      previous(unraisable)

  sys.unraisablehook = hook
  logging.getLogger("asyncio").addFilter(lambda record: not _from_orbax(record.exc_info))


def restore_latest(manager: ocp.CheckpointManager, state: Any, workdir: str, *,
                   start_over: str = "start over with a new --workdir") -> tuple[Any, int]:
  """(the state of the latest checkpoint in `manager`, its step), or (`state`, 0) if none.

  `workdir` holds the manager's checkpoints; `start_over` says how its runs start anew.

  Raises:
    CheckpointError: that checkpoint cannot be read back into the structure of `state`.
  """
  step = manager.latest_step()
  if step is None:
    return state, 0
  try:
    return manager.restore(step, args=ocp.args.StandardRestore(state)), step
  # Orbax re-raises TensorStore's read failures as bare Exceptions whose text is the store's
  # whole specification; what a user needs is which checkpoint failed and what to do.
  except Exception as error:
    _quiet_abandoned_reads()
    checkpoints = f"{workdir}/{CHECKPOINT_DIR}"
    earlier = [kept for kept in manager.all_steps() if kept < step]
    way_on = (f"move {checkpoints}/{step} out of {checkpoints} to resume from step "
              f"{max(earlier)}, the latest earlier checkpoint kept, or {start_over}"
              if earlier else start_over)
    raise CheckpointError(
        f"the checkpoint of step {step} in {checkpoints}/{step} cannot be restored: it is "
        f"corrupt or incomplete. Nothing in {workdir} was changed; to go on, {way_on}.") from error


def validate_run_config(config: ml_collections.ConfigDict) -> None:
  """Rejects the loop's keys with impossible values before a task is built or compiled."""
  # The data order is np.random.default_rng((seed, epoch)), which refuses a negative seed.
  validation.integer("config.seed", config.seed, minimum=0)
  validation.integer("config.num_steps", config.num_steps, minimum=1)
  validation.integer("config.checkpoint_every", config.checkpoint_every, minimum=1)
  validation.integer("config.checkpoints_to_keep", config.get("checkpoints_to_keep", 2),
                     minimum=1)
  validation.integer("config.eval_every", config.eval_every, minimum=0)
  profile_steps(config)


def profile_steps(config: ml_collections.ConfigDict) -> range:
  """The steps to trace, from config.profile_steps "A:B" (A <= step < B); "" traces none."""
  spec = config.get("profile_steps", "")
  if not spec:
    return range(0)
  first, sep, stop = spec.partition(":")
  valid = sep and first.isdigit() and stop.isdigit()
  if not (valid and int(first) < int(stop) <= config.num_steps):
    raise ValueError(f"config.profile_steps must be 'A:B' with 0 <= A < B <= num_steps "
                     f"({config.num_steps}); got {spec!r}.")
  return range(int(first), int(stop))


def _setting(config: ml_collections.ConfigDict) -> tuple[Any, str]:
  """The module of the setting config.task names, and the name of its task's class."""
  if config.task not in SETTINGS:
    raise ValueError(f"config.task must be one of {', '.join(SETTINGS)}; got {config.task!r}.")
  module, task_class = SETTINGS[config.task]
  return importlib.import_module(module), task_class


def build_task(config: ml_collections.ConfigDict) -> Task:
  """The task named by config.task."""
  module, task_class = _setting(config)
  return getattr(module, task_class)(config)


def check_config(config: ml_collections.ConfigDict) -> None:
  """The checks of `config` that `run` makes before it compiles, without building the task:
  the loop's keys, then its setting's for one device (a task checks its own mesh when built,
  and a batch of runs trains on one device)."""
  validate_run_config(config)
  _setting(config)[0].validate_config(config, 1)


def batch_of(workdir: epath.PathLike) -> str | None:
  """The directory of the batch that trains (or trained) the run in `workdir`, or None."""
  mark = files.path(workdir) / BATCH_MARK
  return json.loads(mark.read_text())["batch_dir"] if mark.exists() else None


def _stored_rows(text: str) -> list[dict]:
  """The rows of the JSON lines `text`; a last line a kill cut short (never valid JSON) is none."""
  *lines, last = text.split("\n")
  rows = [json.loads(line) for line in lines if line.strip()]
  with contextlib.suppress(json.JSONDecodeError):  # "" after the last newline, or a cut row
    rows.append(json.loads(last))
  return rows


def read_metrics(workdir: epath.PathLike) -> list[dict]:
  """The metric rows of a run directory (local or a URL): one a step, in step order.

  The stored rows are read in the order they were written (the metrics.jsonl of a run by an
  earlier version first, then the parts of metrics/), and each row replaces the rows before
  it of its step and later steps: those a resumed leg redoes.
  """
  directory = files.path(workdir)
  legacy = directory / LEGACY_METRICS_FILE
  stored = [legacy] if legacy.exists() else []
  stored += [path for _, _, path in _metric_parts(directory)]
  rows = []
  for path in stored:
    for row in _stored_rows(path.read_text()):
      while rows and rows[-1]["step"] >= row["step"]:
        rows.pop()
      rows.append(row)
  return rows


def _is_floating(leaf) -> bool:
  return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


@jax.jit
def _finite_flags(state: Any) -> jax.Array:
  """bool [number of floating leaves]: each floating leaf of `state` is all finite."""
  return jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(state)
                    if _is_floating(leaf)] or [jnp.bool_(True)])


# Each run's flags of a batched state (a leading run axis), in one program.
_finite_flags_of_runs = jax.jit(jax.vmap(_finite_flags))


def _paths_not_finite(state: Any, flags: np.ndarray) -> list[str]:
  """The paths of the floating leaves of `state` whose `flags` are False."""
  if flags.all():
    return []
  paths = ["state" + jax.tree_util.keystr(path)
           for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0] if _is_floating(leaf)]
  return [path for path, finite in zip(paths, flags, strict=True) if not finite]


def non_finite_leaves(state: Any) -> list[str]:
  """The paths of the floating leaves of `state` that hold NaN or inf (one device sync).

  The paths are named only when some leaf is bad, so the per-step check costs one
  jitted reduction over the state.
  """
  return _paths_not_finite(state, jax.device_get(_finite_flags(state)))


def non_finite_leaves_of_runs(states: Any) -> list[list[str]]:
  """`non_finite_leaves` of each run of a batched state (a leading run axis), in one device
  sync for the whole batch (slicing out each run would dispatch an op per leaf and run)."""
  return [_paths_not_finite(states, flags)
          for flags in jax.device_get(_finite_flags_of_runs(states))]


def _to_floats(metrics: Mapping[str, Any]) -> dict[str, float]:
  return {name: float(value) for name, value in jax.device_get(dict(metrics)).items()}


def check_same_run(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Refuses (ValueError) a workdir that holds a run of a different config.

  The command-line entry points call it before `run`, which itself also resumes
  a run whose config changed (e.g. to train it for more steps).
  """
  saved = files.path(workdir) / CONFIG_FILE
  if not saved.exists():
    return
  before = json.loads(saved.read_text())
  now = json.loads(config.to_json_best_effort())
  changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
  if changed:
    raise ValueError(
        f"{workdir} holds a run with a different config ({', '.join(changed)} differ); "
        f"choose another --workdir or delete it.")


def run(config: ml_collections.ConfigDict, workdir: str, *, resume: bool = False,
        task: Task | None = None) -> list[dict]:
  """Trains `config` in `workdir` (resuming from its latest checkpoint) and returns the rows.

  Args:
    config: the experiment config (see sera_jax.harness.configs).
    workdir: output directory, local or a URL (gs://...); an existing one with
      checkpoints is resumed.
    resume: require a checkpoint to resume from (error if there is none).
    task: a prebuilt task (default: `build_task(config)`).
  """
  # Every config value is checked, and the model built, before anything is written.
  validate_run_config(config)
  batch_dir = batch_of(workdir)
  if batch_dir is not None:
    raise ValueError(f"{workdir} holds a run of the batch in {batch_dir}, whose checkpoints "
                     f"hold its state: go on as it was trained (the same sweep or figure, "
                     f"batched), or delete the workdir to train it alone.")
  task = task or build_task(config)
  state = task.init_state(jax.random.PRNGKey(config.seed))
  directory = files.path(workdir)
  nothing_to_resume = f"--resume: no checkpoint in {workdir}/{CHECKPOINT_DIR} to resume from."
  if resume and not (directory / CHECKPOINT_DIR).exists():
    raise FileNotFoundError(nothing_to_resume)  # before anything is created
  directory.mkdir(parents=True, exist_ok=True)
  is_writer = jax.process_index() == 0
  manager = ocp.CheckpointManager(
      directory / CHECKPOINT_DIR,
      options=ocp.CheckpointManagerOptions(max_to_keep=config.get("checkpoints_to_keep", 2),
                                           create=True))
  # The checkpoint is read back before anything in the workdir is written.
  try:
    state, start = restore_latest(manager, state, workdir)
    if resume and not start:
      raise FileNotFoundError(nothing_to_resume)
  except (CheckpointError, FileNotFoundError):
    manager.close()
    raise
  log = None
  if is_writer:
    # Rows after the checkpoint we resume from are dropped: those steps are redone.
    rows = [row for row in read_metrics(directory) if row["step"] < start]
    files.write_text(directory / CONFIG_FILE, config.to_json_best_effort(indent=2))
    log = MetricLog(directory, start)
  else:
    rows = []
  progress = tqdm.tqdm(range(start, config.num_steps), initial=start, total=config.num_steps,
                       desc=f"{config.task}/{config.get('method', '')}", disable=not is_writer,
                       dynamic_ncols=True)
  last_saved = start
  profile = Profile(profile_steps(config), directory / PROFILE_DIR)
  try:
    for step in progress:
      profile.before(step)
      state, step_metrics = task.train_step(state, step)
      profile.after(step, state)
      row = {"step": step} | _to_floats(step_metrics)
      # The metrics describe the state before the update; the new state is checked
      # itself, so a poisoned update is never saved as a good checkpoint.
      bad = sorted(name for name, value in row.items() if not math.isfinite(value))
      bad += non_finite_leaves(state)
      if bad:
        listed = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        kept = (f"the last good checkpoint (step {last_saved}) is kept in "
                f"{workdir}/{CHECKPOINT_DIR}" if last_saved else "it saved no checkpoint")
        raise NonFiniteError(f"non-finite {listed} at step {step}; the run stops here and "
                             f"{kept}.", step)
      done = step + 1
      if config.eval_every and (done % config.eval_every == 0 or done == config.num_steps):
        row |= task.evaluate(state)
      if is_writer:
        log.write(row)
        rows.append(row)
        progress.set_postfix({k.split("/")[-1]: f"{row[k]:.3f}" for k in PROGRESS_KEYS if k in row},
                             refresh=False)
      if done % config.checkpoint_every == 0 or done == config.num_steps:
        if is_writer:
          log.flush()
        manager.save(done, args=ocp.args.StandardSave(state))
        last_saved = done
  finally:
    profile.stop()
    manager.wait_until_finished()
    manager.close()
    progress.close()
    if log is not None:
      log.close()
  if is_writer:
    task.write_figures(workdir, rows)
  return rows


def summarize(rows: list[dict]) -> dict[str, float]:
  """Means over the run of every metric present in all rows."""
  names = set.intersection(*(set(row) for row in rows)) - {"step"} if rows else set()
  return {name: float(np.mean([row[name] for row in rows])) for name in sorted(names)}
