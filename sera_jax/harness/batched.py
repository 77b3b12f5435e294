"""A grid of runs trained as one program, each run writing its own workdir as `train.run` does.

`run_batch` trains R configs of one setting that differ in seed and optimizer scalars
(`sera_jax.settings.classification.batched`, `sera_jax.settings.maze.batched`,
`sera_jax.settings.sim.batched`) with one vmapped step. Each run's workdir gets what
`train.run` writes there: config.json, the metric rows and TensorBoard events
(`train.MetricLog`; `train.read_metrics` reads them back), a step's row with the run's
evaluation every config.eval_every steps, and the setting's figures. The batch's own directory
holds runs.json (its workdirs) and Orbax checkpoints of the batched state with each run's
liveness, saved as `train.run` saves (every config.checkpoint_every steps and at the end, the
rows flushed first), so a batch killed at any point and run again resumes from its latest
checkpoint and writes exactly the rows of an uninterrupted batch. A run whose row or new state
is non-finite stops there, as `train.run` stops (that row and the later ones are not written);
the other runs go on. When the batch ends, each run's workdir gets batch_run.json
(`run_outcome`): the batch that trained it, its steps, and the step at which it stopped, if it
did, so a sweep or a figure knows the run is done without the batch's checkpoints.
"""

import hashlib
import json
import logging
import math
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from sera_jax.common import batching, files
from sera_jax.harness import train

RUNS_FILE = "runs.json"
OUTCOME_FILE = "batch_run.json"  # in a run's workdir, written when its batch ends


class RunOutcome(NamedTuple):
  """How a run of a batch ended (batch_run.json in its workdir)."""
  batch_dir: str
  num_steps: int  # the steps the batch trained
  stopped_at: int | None  # the step whose update went non-finite (no row from it on); None


def run_outcome(workdir: str) -> RunOutcome | None:
  """How the batch that trained `workdir` ended; None when no batch finished it."""
  location = files.path(workdir) / OUTCOME_FILE
  return RunOutcome(**json.loads(location.read_text())) if location.exists() else None


class Batch(Protocol):
  """R runs of a setting as one program (`BatchedClassification`, `BatchedMaze`, `BatchedSim`)."""
  configs: list[ml_collections.ConfigDict]
  def init_state(self) -> Any: ...
  def train_step(self, states: Any, step: int) -> tuple[Any, dict[str, jax.Array]]: ...
  def evaluate(self, states: Any) -> list[dict[str, float]]: ...
  def write_figures(self, workdir: str, rows: list[dict]) -> None: ...


def build_batch(configs: Sequence[ml_collections.ConfigDict], mesh=None) -> Batch:
  """The batch of the setting config.task names (`batching.runs_mesh` for `mesh`)."""
  task = configs[0].task if configs else None
  if task == "classification":
    from sera_jax.settings.classification.batched import BatchedClassification
    return BatchedClassification(configs, mesh)
  if task == "maze":
    from sera_jax.settings.maze.batched import BatchedMaze
    return BatchedMaze(configs, mesh)
  if task == "sim":
    from sera_jax.settings.sim.batched import BatchedSim
    return BatchedSim(configs, mesh)
  raise ValueError(f"a batch of runs needs config.task 'classification', 'maze' or 'sim'; "
                   f"got {task!r}.")


def varied_keys(task: str) -> tuple[str, ...]:
  """The config keys the runs of a batch of `task` may differ in; () for a task with no batch."""
  if task == "classification":
    from sera_jax.settings.classification.batched import VARIED
    return VARIED
  if task in ("maze", "sim"):
    from sera_jax.settings.maze.batched import VARIED
    return VARIED
  return ()


def batch_groups(configs: Sequence[ml_collections.ConfigDict]) -> list[list[int]]:
  """The indices of `configs` grouped into batches: configs of a task that batches, equal in
  every key but `varied_keys(task)`, share one; every other config is a group of its own.
  Groups come in the order of their first config."""
  groups: dict[str, list[int]] = {}
  for index, config in enumerate(configs):
    varied = varied_keys(config.task)
    shared = {key: value for key, value in batching.flat_config(config).items()
              if key not in varied}
    key = json.dumps(sorted(shared.items()), default=repr) if varied else f"alone {index}"
    groups.setdefault(key, []).append(index)
  return list(groups.values())


def default_batch_dir(workdirs: Sequence[str]) -> str:
  """Where a batch of `workdirs` keeps its state: beside the first, named by all of them."""
  digest = hashlib.sha1("\n".join(workdirs).encode()).hexdigest()[:12]
  return str(files.path(workdirs[0]).parent / f"batch-{digest}")


def _check_workdirs(configs, workdirs, batch_dir) -> bool:
  """Refuses bad workdirs; True when `batch_dir` holds this batch (to resume)."""
  if len(workdirs) != len(configs):
    raise ValueError(f"{len(configs)} configs need as many workdirs; got {len(workdirs)}.")
  if len(set(workdirs)) != len(workdirs):
    raise ValueError("every run of a batch needs its own workdir; some are the same.")
  for config in configs:
    train.validate_run_config(config)
  runs_file = files.path(batch_dir) / RUNS_FILE
  if runs_file.exists():
    if json.loads(runs_file.read_text()) != list(workdirs):
      raise ValueError(f"{batch_dir} holds a batch of other workdirs; choose another batch "
                       f"directory or delete it.")
    return True
  for workdir in workdirs:
    if train.read_metrics(workdir):
      other = train.batch_of(workdir)
      trained = f"of the batch in {other}" if other else "trained alone"
      raise ValueError(f"{workdir} holds the rows of a run {trained}, not of this batch: go "
                       f"on as it was trained (its sweep or figure again, as it was), or "
                       f"delete the workdir.")
  return False


def _non_finite(row: dict, non_finite_leaves: list[str]) -> list[str]:
  """The metrics of `row` that are NaN or inf, then the run's `non_finite_leaves`."""
  return (sorted(name for name, value in row.items() if not math.isfinite(value))
          + non_finite_leaves)


def run_batch(configs: Sequence[ml_collections.ConfigDict], workdirs: Sequence[str], *,
              batch_dir: str | None = None, mesh=None, batch: Batch | None = None
              ) -> list[list[dict]]:
  """Trains `configs` as one program, run r writing `workdirs[r]`; returns each run's rows.

  Args:
    configs: the runs (`build_batch` refuses keys they may not differ in).
    workdirs: one a run, local or URLs.
    batch_dir: the batch's checkpoints and runs.json (default `default_batch_dir`); one
      holding this batch's checkpoints is resumed from the latest.
    mesh: a `batching.runs_mesh` to split the runs over (default one device).
    batch: a prebuilt batch (default `build_batch(configs, mesh)`).
  """
  workdirs = list(workdirs)
  batch_dir = batch_dir or default_batch_dir(workdirs)
  resuming = _check_workdirs(configs, workdirs, batch_dir)
  batch = batch or build_batch(configs, mesh)
  config = batch.configs[0]  # the keys the runs share
  saved = {"states": batch.init_state(), "live": np.ones(len(configs), bool)}
  manager = ocp.CheckpointManager(
      files.path(batch_dir) / train.CHECKPOINT_DIR,
      options=ocp.CheckpointManagerOptions(max_to_keep=config.get("checkpoints_to_keep", 2),
                                           create=True))
  try:
    saved, start = (train.restore_latest(
        manager, saved, batch_dir,
        start_over=f"start over: delete {batch_dir} and the workdirs its {RUNS_FILE} lists")
        if resuming else (saved, 0))
  except train.CheckpointError:
    manager.close()
    raise
  states, live = saved["states"], [r for r, alive in enumerate(saved["live"]) if alive]
  files.write_text(files.path(batch_dir) / RUNS_FILE, json.dumps(workdirs))
  logs, rows = [], []
  for run, workdir in zip(batch.configs, workdirs, strict=True):
    directory = files.path(workdir)
    directory.mkdir(parents=True, exist_ok=True)
    files.write_text(directory / train.BATCH_MARK, json.dumps({"batch_dir": str(batch_dir)}))
    # Rows after the checkpoint resumed from are dropped: those steps are redone.
    rows.append([row for row in train.read_metrics(directory) if row["step"] < start])
    files.write_text(directory / train.CONFIG_FILE, run.to_json_best_effort(indent=2))
    logs.append(train.MetricLog(directory, start))
  try:
    for step in range(start, config.num_steps):
      states, metrics = batch.train_step(states, step)
      metrics = jax.device_get(metrics)
      leaves = train.non_finite_leaves_of_runs(states)
      new = {}
      for r in list(live):
        row = {"step": step} | {name: float(value[r]) for name, value in metrics.items()}
        bad = _non_finite(row, leaves[r])
        if bad:
          live.remove(r)
          logging.warning("%s: non-finite %s at step %d; this run stops here (its rows end at "
                          "step %d), the batch's other runs go on.", workdirs[r],
                          ", ".join(bad[:5]), step, step - 1)
        else:
          new[r] = row
      done = step + 1
      if config.eval_every and (done % config.eval_every == 0 or done == config.num_steps):
        for r, evaluation in enumerate(batch.evaluate(states)):
          if r in new:
            new[r] |= evaluation
      for r, row in new.items():
        logs[r].write(row)
        rows[r].append(row)
      if done % config.checkpoint_every == 0 or done == config.num_steps:
        for log in logs:
          log.flush()
        alive = np.zeros(len(configs), bool)
        alive[live] = True
        manager.save(done, args=ocp.args.StandardSave({"states": states, "live": alive}))
      if not live:
        break
  finally:
    manager.wait_until_finished()
    manager.close()
    for log in logs:
      log.close()
  for r, (workdir, run_rows) in enumerate(zip(workdirs, rows, strict=True)):
    batch.write_figures(workdir, run_rows)
    stopped_at = None if r in live else (run_rows[-1]["step"] + 1 if run_rows else 0)
    files.write_text(files.path(workdir) / OUTCOME_FILE, json.dumps(
        RunOutcome(str(batch_dir), config.num_steps, stopped_at)._asdict()))
  return rows
