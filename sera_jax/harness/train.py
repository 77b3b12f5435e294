"""The training loop: one task, checkpoints, metric writers, resume.

A task (classification as RL, maze navigation) is an object with

  init_state(rng) -> state            a pytree of arrays: everything to resume
  train_step(state, step) -> (state, metrics)
  evaluate(state) -> dict             held-out metrics, every config.eval_every
  write_figures(workdir, rows)        figures drawn from the metric rows

`run` drives it: it restores the latest Orbax checkpoint of the workdir if
there is one, runs to config.num_steps, appends one JSON object per step to
metrics.jsonl and to TensorBoard, saves checkpoints every
config.checkpoint_every steps and stops on non-finite metrics or a non-finite
new state (parameters, optimizer state: any floating leaf), before that state
can be saved, keeping the last good checkpoint. Batches and RNG depend only on
the step number (data position = step, RNG = fold_in(rng, step)), so a run
killed at any point and resumed writes exactly the metrics of an uninterrupted
run.
"""

import json
import math
import os
from collections.abc import Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import tqdm

from sera_jax.common.tf import tensorflow
from sera_jax.method import validation

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
CHECKPOINT_DIR = "checkpoints"
TENSORBOARD_DIR = "tensorboard"
PROFILE_DIR = "profile"
PROGRESS_KEYS = ("cos/sera_expected", "cos/uniform_expected", "loss", "accuracy", "pass@1")


class Task(Protocol):
  def init_state(self, rng: jax.Array) -> Any: ...
  def train_step(self, state: Any, step: int) -> tuple[Any, Mapping[str, jax.Array]]: ...
  def evaluate(self, state: Any) -> dict[str, float]: ...
  def write_figures(self, workdir: str, rows: list[dict]) -> None: ...


class TensorBoardWriter:
  """Scalars into TensorBoard event files with tf.summary (whose files also reach gs:// URLs)."""

  def __init__(self, logdir: str):
    self._tf = tensorflow()
    self._writer = self._tf.summary.create_file_writer(logdir)

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    with self._writer.as_default(step=step):
      for name, value in scalars.items():
        self._tf.summary.scalar(name, value)

  def close(self) -> None:
    self._writer.close()


class NonFiniteError(FloatingPointError):
  """Raised when a step produced NaN or inf; the last good checkpoint is kept."""


def validate_run_config(config: ml_collections.ConfigDict) -> None:
  """Rejects the loop's keys with impossible values before a task is built or compiled."""
  validation.integer("config.seed", config.seed)
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


def build_task(config: ml_collections.ConfigDict) -> Task:
  """The task named by config.task."""
  if config.task == "classification":
    from sera_jax.settings.classification.task import ClassificationTask
    return ClassificationTask(config)
  if config.task == "maze":
    from sera_jax.settings.maze.task import MazeTask
    return MazeTask(config)
  raise ValueError(f"config.task must be 'classification' or 'maze'; got {config.task!r}.")


def read_metrics(workdir: str) -> list[dict]:
  """The metric rows of a run directory, in step order."""
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _is_floating(leaf) -> bool:
  return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


@jax.jit
def _finite_flags(state: Any) -> jax.Array:
  """bool [number of floating leaves]: each floating leaf of `state` is all finite."""
  return jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(state)
                    if _is_floating(leaf)] or [jnp.bool_(True)])


def non_finite_leaves(state: Any) -> list[str]:
  """The paths of the floating leaves of `state` that hold NaN or inf (one device sync).

  The paths are named only when some leaf is bad, so the per-step check costs one
  jitted reduction over the state.
  """
  flags = jax.device_get(_finite_flags(state))
  if flags.all():
    return []
  paths = ["state" + jax.tree_util.keystr(path)
           for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0] if _is_floating(leaf)]
  return [path for path, finite in zip(paths, flags, strict=True) if not finite]


def _keep_rows_before(workdir: str, step: int) -> list[dict]:
  """Drops rows written after the checkpoint we resume from (they are redone)."""
  rows = [row for row in read_metrics(workdir) if row["step"] < step]
  with open(os.path.join(workdir, METRICS_FILE), "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
  return rows


def _to_floats(metrics: Mapping[str, Any]) -> dict[str, float]:
  return {name: float(value) for name, value in jax.device_get(dict(metrics)).items()}


def check_same_run(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Refuses (ValueError) a workdir that holds a run of a different config.

  The command-line entry points call it before `run`, which itself also resumes
  a run whose config changed (e.g. to train it for more steps).
  """
  saved = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(saved):
    return
  with open(saved) as f:
    before = json.load(f)
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
    workdir: output directory; an existing one with checkpoints is resumed.
    resume: require a checkpoint to resume from (error if there is none).
    task: a prebuilt task (default: `build_task(config)`).
  """
  validate_run_config(config)
  if "://" in str(workdir):
    raise ValueError(
        f"workdir {workdir}: URL workdirs are not supported yet (run files are written with "
        f"local file I/O); give a local path or a shared-filesystem mount (on GCP, a gcsfuse "
        f"mount of the bucket).")
  task = task or build_task(config)
  is_writer = jax.process_index() == 0
  os.makedirs(workdir, exist_ok=True)
  manager = ocp.CheckpointManager(
      os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR)),
      options=ocp.CheckpointManagerOptions(max_to_keep=config.get("checkpoints_to_keep", 2),
                                           create=True))
  state = task.init_state(jax.random.PRNGKey(config.seed))
  start = manager.latest_step() or 0
  if resume and not start:
    raise FileNotFoundError(
        f"--resume: no checkpoint in {workdir}/{CHECKPOINT_DIR} to resume from.")
  if start:
    state = manager.restore(start, args=ocp.args.StandardRestore(state))
  rows = _keep_rows_before(workdir, start) if is_writer else []
  if is_writer:
    with open(os.path.join(workdir, CONFIG_FILE), "w") as f:
      f.write(config.to_json_best_effort(indent=2))
  writer = TensorBoardWriter(os.path.join(workdir, TENSORBOARD_DIR)) if is_writer else None
  metrics_file = open(os.path.join(workdir, METRICS_FILE), "a") if is_writer else None  # noqa: SIM115
  progress = tqdm.tqdm(range(start, config.num_steps), initial=start, total=config.num_steps,
                       desc=f"{config.task}/{config.get('method', '')}", disable=not is_writer,
                       dynamic_ncols=True)
  last_saved = start
  traced, tracing = profile_steps(config), False
  try:
    for step in progress:
      if step in traced and not tracing:  # (a resumed run traces the rest of the window)
        jax.profiler.start_trace(os.path.join(workdir, PROFILE_DIR))
        tracing = True
      state, step_metrics = task.train_step(state, step)
      if tracing and step == traced.stop - 1:
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        tracing = False
      row = {"step": step} | _to_floats(step_metrics)
      # The metrics describe the state before the update; the new state is checked
      # itself, so a poisoned update is never saved as a good checkpoint.
      bad = sorted(name for name, value in row.items() if not math.isfinite(value))
      bad += non_finite_leaves(state)
      if bad:
        listed = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise NonFiniteError(
            f"non-finite {listed} at step {step}; the run stops here and the last "
            f"good checkpoint (step {last_saved}) is kept in {workdir}/{CHECKPOINT_DIR}.")
      done = step + 1
      if config.eval_every and (done % config.eval_every == 0 or done == config.num_steps):
        row |= task.evaluate(state)
      if is_writer:
        metrics_file.write(json.dumps(row) + "\n")
        metrics_file.flush()
        writer.write(step, {name: value for name, value in row.items() if name != "step"})
        rows.append(row)
        progress.set_postfix({k.split("/")[-1]: f"{row[k]:.3f}" for k in PROGRESS_KEYS if k in row},
                             refresh=False)
      if done % config.checkpoint_every == 0 or done == config.num_steps:
        manager.save(done, args=ocp.args.StandardSave(state))
        last_saved = done
  finally:
    if tracing:
      jax.profiler.stop_trace()
    manager.wait_until_finished()
    manager.close()
    progress.close()
    if is_writer:
      metrics_file.close()
      writer.close()
  if is_writer:
    task.write_figures(workdir, rows)
  return rows


def summarize(rows: list[dict]) -> dict[str, float]:
  """Means over the run of every metric present in all rows."""
  names = set.intersection(*(set(row) for row in rows)) - {"step"} if rows else set()
  return {name: float(np.mean([row[name] for row in rows])) for name in sorted(names)}
