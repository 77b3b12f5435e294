"""A grid of classification runs trained as one program, each run writing its own workdir.

`run_batch` trains R configs that differ in seed and optimizer scalars
(`sera_jax.settings.classification.batched`) with one vmapped step, and writes each run's
config.json and metric rows to its own workdir as `train.run` writes them (`MetricLog`;
`train.read_metrics` reads them back): a step's row, and every config.eval_every steps
the run's evaluation. It keeps no checkpoint, so a workdir that already holds rows is
refused. A run whose row or new state is non-finite stops there, as `train.run` stops
(that row and the later ones are not written); the other runs go on.
"""

import math
from collections.abc import Sequence

import jax
import ml_collections

from sera_jax.common import files
from sera_jax.harness import train
from sera_jax.settings.classification.batched import BatchedClassification, run_state


def _check_workdirs(configs, workdirs) -> None:
  if len(workdirs) != len(configs):
    raise ValueError(f"{len(configs)} configs need as many workdirs; got {len(workdirs)}.")
  if len(set(workdirs)) != len(workdirs):
    raise ValueError("every run of a batch needs its own workdir; some are the same.")
  for config, workdir in zip(configs, workdirs, strict=True):
    train.validate_run_config(config)
    if train.read_metrics(workdir):
      raise ValueError(f"{workdir} holds a run's rows and a batch of runs does not resume; "
                       f"choose another workdir or delete it.")


def run_batch(configs: Sequence[ml_collections.ConfigDict],
              workdirs: Sequence[str]) -> list[list[dict]]:
  """Trains `configs` as one program, run r writing `workdirs[r]`; returns each run's rows."""
  _check_workdirs(configs, workdirs)
  batch = BatchedClassification(configs)
  config = batch.configs[0]  # the keys the runs share
  logs = []
  for run, workdir in zip(batch.configs, workdirs, strict=True):
    directory = files.path(workdir)
    directory.mkdir(parents=True, exist_ok=True)
    files.write_text(directory / train.CONFIG_FILE, run.to_json_best_effort(indent=2))
    logs.append(train.MetricLog(directory))
  rows = [[] for _ in configs]
  live = list(range(len(configs)))
  states = batch.init_state()
  try:
    for step in range(config.num_steps):
      states, metrics = batch.train_step(states, step)
      metrics = jax.device_get(metrics)
      for r in list(live):
        row = {"step": step} | {name: float(value[r]) for name, value in metrics.items()}
        if not all(map(math.isfinite, row.values())) or train.non_finite_leaves(
            run_state(states, r)):
          live.remove(r)
        else:
          rows[r].append(row)
      done = step + 1
      if config.eval_every and (done % config.eval_every == 0 or done == config.num_steps):
        for r, evaluation in enumerate(batch.evaluate(states)):
          if r in live:
            rows[r][-1] |= evaluation
      for r in live:
        logs[r].write(rows[r][-1])
      if not live:
        break
  finally:
    for log in logs:
      log.close()
  for workdir, run_rows in zip(workdirs, rows, strict=True):
    batch.task.write_figures(workdir, run_rows)
  return rows

