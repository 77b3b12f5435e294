"""Budget scaling (`sera-jax figure scaling`): a smoke run of its tuned, batched grid, its cache,
and how it reports a diverged run."""

import numpy as np
import pytest
from manifests import assert_manifest

from sera_jax.common import files
from sera_jax.harness.figures import common


@pytest.mark.slow
def test_budget_scaling_smoke_and_its_cache_refuses_a_run_of_another_config(tmp_path, capsys):
  from sera_jax.harness.figures import scaling
  # Two rates at the tuning seed 100, then seeds 1 and 2 at the chosen rate: both batches of a
  # (method, N0) are one program (of 2 runs), compiled once.
  args = ["--baselines", "2", "4", "--seeds", "1", "2", "--num-steps", "4",
          "--methods", "ce", "uniform", "sera", "--learning-rates", "0.05", "0.2",
          "--workdir-root", str(tmp_path / "runs"), "--out", str(tmp_path)]
  scaling.main([*args, "--eval-every", "2"])
  rows = files.read_csv(tmp_path / "budget_scaling.csv")
  protocol = assert_manifest(tmp_path, "budget_scaling", "figure scaling",
                             [*args, "--eval-every", "2"], [1, 2], [100])["protocol"]
  assert (protocol["baselines"], protocol["num_steps"], protocol["eval_every"]) == ([2, 4], 4, 2)
  assert {"ce/2", "uniform/4", "sera/2"} <= protocol["learning_rates"].keys()
  assert {(r["N0"], r["method"]) for r in rows} == {
      (n0, m) for n0 in ("2", "4") for m in ("ce", "uniform", "sera")}
  assert sorted({int(r["step"]) for r in rows}) == [2, 4]
  ce = {(r["N0"], r["seed"], r["step"]): r["pass@1"] for r in rows if r["method"] == "ce"}
  assert ce["2", "1", "4"] == ce["4", "1", "4"]  # one ce run per seed, drawn at every N0
  assert (tmp_path / "budget_scaling.png").stat().st_size > 0
  out = capsys.readouterr().out
  assert "sera - uniform" in out and "seed 1; sera N0=2 lr" in out and "seed 2: one batch" in out
  assert len(list((tmp_path / "runs" / "4steps").iterdir())) == 3  # ce, N0=2, N0=4
  # The tuning seed at both rates, seeds 1 and 2 at the chosen one: 4 runs for ce and for
  # each (method, N0), trained as two batches; the tuning seed is not reported.
  trained = [path.name for path in (tmp_path / "runs" / "4steps" / "N0=2").iterdir()]
  assert len([name for name in trained if not name.startswith("batch-")]) == 2 * 4
  assert len([name for name in trained if name.startswith("batch-")]) == 2 * 2
  assert {r["seed"] for r in rows} == {"1", "2"}
  grid = files.read_csv(tmp_path / "budget_scaling_rates.csv")
  assert {r["seed"] for r in grid} == {"100"}
  assert len(grid) == 2 * (1 + 2 * 2) and (tmp_path / "budget_scaling_rates.png").stat().st_size
  chosen = {(r["N0"], r["method"]): r["learning_rate"] for r in grid if r["chosen"] == "True"}
  assert {(r["N0"], r["method"]): r["learning_rate"] for r in rows
          if r["method"] != "ce"} == {key: rate for key, rate in chosen.items() if key[0]}
  assert {r["learning_rate"] for r in rows if r["method"] == "ce"} == {chosen["", "ce"]}
  # The cached runs were evaluated every 2 steps: asked for every 4, they are refused, not
  # returned as if they were the runs asked for.
  with pytest.raises(SystemExit, match="different config \\(eval_every differ\\)"):
    scaling.main([*args, "--eval-every", "4"])


def test_budget_scaling_reports_a_diverged_run_instead_of_a_number():
  from sera_jax.harness.figures import scaling
  finished = {"step": [10, 20], "pass@1": [0.1, 0.3], "pass@256": [0.2, 0.5], "diverged": None}
  stopped = {"step": [10], "pass@1": [0.2], "pass@256": [0.4], "diverged": 17}
  results = {("sera", 16): common.TunedRuns(0.1, {}, {}, {0: finished, 1: stopped}),
             ("uniform", 16): common.TunedRuns(0.1, {}, {}, {0: finished, 1: finished})}
  steps, values = scaling._padded(results["sera", 16].runs, [0, 1], "pass@1")
  np.testing.assert_array_equal(steps, [10, 20])
  np.testing.assert_array_equal(values, [[0.1, 0.3], [0.2, np.nan]])
  np.testing.assert_array_equal(scaling.final(results, "sera", 16, [0, 1], 1), [0.3, np.nan])
  table = scaling.table(results, ["uniform", "sera"], [16], [0, 1])
  assert "diverged in 1 of 2 seeds" in table and "0.300 ± 0.000" in table
