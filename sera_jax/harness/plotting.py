"""`sera-jax plot`: the alignment figure of run directories, labelled from their configs."""

import json
import os

from sera_jax.common import files
from sera_jax.harness.train import CONFIG_FILE, METRICS_DIR, read_metrics
from sera_jax.settings.classification.plots import plot_alignment


def run_labels(configs: list[dict], names: list[str]) -> list[str]:
  """Legend labels of runs: the method, then the config keys that tell equal methods apart.

  Args:
    configs: each run's config.json (may be empty).
    names: each run's directory name, the last resort when configs are equal.
  """
  labels = [str(config.get("method", name)) for config, name in zip(configs, names, strict=True)]
  for label in set(labels):
    same = [i for i, other in enumerate(labels) if other == label]
    if len(same) < 2:
      continue
    keys = sorted({key for i in same for key in configs[i]})
    differing = [key for key in keys if key != "method" and
                 len({json.dumps(configs[i].get(key), sort_keys=True) for i in same}) > 1]
    for i in same:
      details = [f"{key}={json.dumps(configs[i].get(key), sort_keys=True)}" for key in differing]
      labels[i] = " ".join([label, *details] if details else [label, f"({names[i]})"])
  return labels


def plot_runs(run_dirs: list[str], path: str, *, window: int = 20) -> dict[str, dict]:
  """`plot_alignment` of run directories into `path` and `path` with suffix .csv.

  Run directories and outputs may be local paths or URLs (gs://...).

  Returns:
    {run label (see `run_labels`): the run's config.json (empty when it has none)}.
  """
  configs, runs = [], []
  for run_dir in run_dirs:
    rows = read_metrics(run_dir)
    if not rows:
      raise FileNotFoundError(f"no metric rows in {run_dir}/{METRICS_DIR}")
    config_path = files.path(run_dir) / CONFIG_FILE
    configs.append(json.loads(config_path.read_text()) if config_path.exists() else {})
    runs.append(rows)
  names = [files.path(run_dir).name for run_dir in run_dirs]
  labels = run_labels(configs, names)
  plot_alignment(list(zip(labels, runs, strict=True)), path, window=window,
                 csv_path=os.fspath(files.path(path).with_suffix(".csv")))
  return dict(zip(labels, configs, strict=True))
