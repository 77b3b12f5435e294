"""The simulation figure (`sera-jax figure sim`): a smoke run of its tuned grid and its outputs."""

import pytest
from manifests import assert_manifest

from sera_jax.common import files
from sera_jax.harness.figures import sim


def test_sim_figure_smoke_writes_every_output_and_reads_finished_runs_back(tmp_path, capsys):
  args = ["--tiny", "--seeds", "2", "--tuning-seeds", "1", "--learning-rates", "0.01", "0.03",
          "--methods", "sera", "uniform", "--workdir", str(tmp_path / "runs"),
          "--out", str(tmp_path)]
  sim.main(args)
  grid = files.read_csv(tmp_path / "sim_passk_tiny_rates.csv")
  assert sorted((r["method"], float(r["learning_rate"]), r["seed"]) for r in grid) == [
      ("sera", 0.01, "100"), ("sera", 0.03, "100"), ("uniform", 0.01, "100"),
      ("uniform", 0.03, "100")]
  rows = files.read_csv(tmp_path / "sim_passk_tiny.csv")
  assert {r["method"] for r in rows} == {"sera", "uniform", "sera - uniform"}
  budget = files.read_csv(tmp_path / "sim_budget_tiny.csv")
  assert [(r["method"], r["seed"]) for r in budget] == [
      ("sera", "0"), ("sera", "1"), ("uniform", "0"), ("uniform", "1")]
  assert all(0 <= float(r["hard_fraction"]) <= 1 for r in budget)
  manifest = assert_manifest(tmp_path, "sim_passk_tiny", "figure sim", args, [0, 1], [100])
  protocol = manifest["protocol"]
  assert (protocol["environment"], protocol["train_scenarios"], protocol["steps"]) == (
      "one_step", 16, 8)
  assert 0 <= protocol["initial_p"]["median"] <= 1
  capsys.readouterr()
  sim.main(args)  # every run is read back, none trained
  assert capsys.readouterr().out.count("finished earlier") == 8


def test_sim_figure_refuses_bad_arguments():
  with pytest.raises(SystemExit):
    sim.main(["--tuning-seeds", "0"])
  with pytest.raises(SystemExit):
    sim.main(["--learning-rates", "0"])
