"""`sera-jax plot`: several run directories overlaid into one PNG and the CSV of its series."""

import csv
import json
import os
import re

import numpy as np
import pytest
from manifests import assert_manifest

from sera_jax.common.plots import smooth
from sera_jax.harness import cli, plotting
from sera_jax.settings.classification import plots
from sera_jax.settings.classification.task import ALIGNED


def _write_run(run_dir, config, num_steps=30, seed=0):
  """A run directory as `sera-jax train` leaves it: config.json and metrics.jsonl."""
  os.makedirs(run_dir)
  rng = np.random.default_rng(seed)
  with open(run_dir / "config.json", "w") as f:
    json.dump(config, f)
  with open(run_dir / "metrics.jsonl", "w") as f:
    for step in range(num_steps):
      row = {"step": step, "rollouts/max": 32.0, "rollouts/std": 4.0, "active_fraction": 0.5}
      row |= {f"cos/{name}": float(rng.uniform(0.2, 0.9)) for name in ALIGNED[1:]}
      f.write(json.dumps(row) + "\n")


def test_plot_two_runs_writes_png_and_csv(tmp_path, capsys):
  _write_run(tmp_path / "a", {"method": "sera", "seed": 0})
  _write_run(tmp_path / "b", {"method": "uniform", "seed": 0}, seed=1)
  out = tmp_path / "fig" / "runs.png"
  os.makedirs(out.parent)
  cli.main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), f"--out={out}", "--window=5"])
  assert "sera, uniform" in capsys.readouterr().out
  manifest = assert_manifest(out.parent, "runs", "plot", [
      str(tmp_path / "a"), str(tmp_path / "b"), f"--out={out}", "--window=5"],
      seeds=[0], tuning_seeds=[])
  assert manifest["protocol"]["runs"] == {"sera": {"method": "sera", "seed": 0},
                                          "uniform": {"method": "uniform", "seed": 0}}
  assert os.path.getsize(out) > 10_000
  with open(tmp_path / "fig" / "runs.csv") as f:
    points = list(csv.DictReader(f))
  assert {p["run"] for p in points} == {"sera", "uniform"}
  sera_expected = [p for p in points if p["run"] == "sera" and p["series"] == "cos/sera_expected"]
  assert [int(p["step"]) for p in sera_expected] == list(range(30))
  values = np.array([float(p["value"]) for p in sera_expected])
  np.testing.assert_allclose([float(p["smoothed"]) for p in sera_expected],
                             smooth(values, 5), rtol=1e-12)
  assert len(points) == 2 * 30 * (len(plots.COSINES) + len(plots.ROLLOUT_STATS))


def test_labels_tell_runs_of_one_method_apart():
  configs = [{"method": "sera", "seed": 0, "lr": 1}, {"method": "sera", "seed": 1, "lr": 1},
             {"method": "uniform", "seed": 0}, {}, {"method": "ce"}, {"method": "ce"}]
  names = ["r0", "r1", "r2", "r3", "r4", "r5"]
  assert plotting.run_labels(configs, names) == [
      "sera seed=0", "sera seed=1", "uniform", "r3", "ce (r4)", "ce (r5)"]


def test_plot_of_a_directory_without_metrics_fails_clearly(tmp_path):
  with pytest.raises(SystemExit, match="no metric rows"):
    cli.main(["plot", str(tmp_path), f"--out={tmp_path}/x.png"])


@pytest.mark.parametrize("args, message", [
    (["--window=0"], r"--window must be >= 1; got 0"),
    (["--out=runs/curves"], r"--out needs a file suffix that names the format"),
])
def test_plot_refuses_a_bad_window_or_an_output_without_a_format(tmp_path, capsys, args,
                                                                  message):
  with pytest.raises(SystemExit):
    cli.main(["plot", str(tmp_path), *args])
  assert re.search(message, capsys.readouterr().err)
