"""Tests of the figure experiments (sera_jax.harness.figures) and the alignment evaluator."""

import argparse
import csv

import jax.numpy as jnp
import numpy as np
import pytest

from sera_jax.common import files
from sera_jax.harness.figures import ablations, budget, common, maze, outcome, scale
from sera_jax.method import success

# Batches of 256 digits: 5 steps an epoch, so 10 steps give snapshots at steps 5 and 10.
TINY = ["--num-steps", "10", "--batch-size", "256"]


def _read_csv(path):
  with open(path) as f:
    return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """The workdir of one tiny training run: the first test to use it trains it, and the
  others (each script's `prepare_run`) find it finished."""
  return str(tmp_path_factory.mktemp("figures") / "run")


def test_snapshot_steps():
  assert common.snapshot_steps(500, 22) == {"early": 22, "mid": 242, "late": 484}
  assert common.snapshot_steps(10, 5) == {"early": 5, "mid": 5, "late": 10}
  with pytest.raises(ValueError, match="one epoch"):
    common.snapshot_steps(4, 5)


@pytest.mark.slow
def test_historical_estimate_replays_the_epochs(run_dir):
  args = argparse.ArgumentParser()
  common.add_run_arguments(args, seeds=None)
  task, workdir, _ = common.prepare_run(args.parse_args([*TINY, "--workdir", run_dir]))
  estimates = common.historical_log_p(task, workdir, [5, 10])
  assert set(estimates) == {5, 10}
  for log_p in estimates.values():
    assert log_p.shape == (task.dataset.num_train,)
    assert np.all(np.asarray(log_p) < 0)
  # After one epoch of 8 uniform rollouts a prompt's estimate is (0.5 + S) / (1 + 8).
  successes = np.exp(np.asarray(estimates[5])) * 9 - 0.5
  np.testing.assert_allclose(successes, np.round(successes), atol=1e-4)
  np.testing.assert_allclose(
      success.pilot_log_p(jnp.asarray(np.round(successes)), 8), estimates[5], atol=1e-6)


@pytest.mark.slow
def test_alignment_vs_budget_smoke(run_dir, tmp_path):
  rows = budget.main(
      [*TINY, "--workdir", run_dir, "--out", str(tmp_path), "--baselines", "2",
       "--seeds", "3"])
  assert (tmp_path / "alignment_vs_budget.png").stat().st_size > 0
  written = _read_csv(tmp_path / "alignment_vs_budget.csv")
  assert len(written) == len(rows) == 3 * len(budget.METHODS)  # snapshots x methods
  assert {r["method"] for r in written} >= {"sera", "knapsack", "gvm", "adaptive"}
  for row in written:
    for field in ("expected_cos", "realized_cos_mean"):
      assert -1 <= float(row[field]) <= 1 + 1e-6
    assert float(row["realized_cos_ci95_low"]) <= float(row["realized_cos_ci95_high"])
  # At N0 = n_min every prompt gets n_min rollouts: "equalized" is uniform, exactly.
  at_n_min = {(r["snapshot"], r["method"]): r for r in rows if r["N0"] == 2}
  for snapshot in ("early", "mid", "late"):
    for field in ("expected_cos", "realized_cos_mean"):
      assert at_n_min[snapshot, "equalized"][field] == at_n_min[snapshot, "uniform"][field]


@pytest.mark.slow
def test_scale_equalization_smoke(run_dir, tmp_path):
  rows = scale.main(
      [*TINY, "--workdir", run_dir, "--out", str(tmp_path)])
  assert (tmp_path / "scale_equalization.png").stat().st_size > 0
  assert len(_read_csv(tmp_path / "scale_equalization.csv")) == len(rows) == 3 * 256
  for snapshot in ("early", "late"):
    points = [r for r in rows if r["snapshot"] == snapshot]
    for mode in ("uniform", "sera"):
      counts = np.array([r[f"{mode}_n"] for r in points])
      assert counts.sum() == 256 * 8  # the same budget M N0
      assert np.all((counts == 0) | ((counts >= 2) & (counts <= 32)))
      assert all(0 <= r[f"{mode}_kappa"] <= 1 for r in points)
    assert 0 < points[0]["sera_waterline"] <= 1


@pytest.mark.slow
def test_ablations_smoke(run_dir, tmp_path):
  rows = ablations.main(
      [*TINY, "--workdir", run_dir, "--out", str(tmp_path), "--batches", "1", "--seeds", "3"])
  assert (tmp_path / "ablations.png").stat().st_size > 0
  assert len(_read_csv(tmp_path / "ablations.csv")) == len(rows)
  overall = {r["variant"]: r for r in rows if r["scope"] == "all"}
  assert overall["SERA (reference)"]["delta_realized"] == 0
  for row in overall.values():
    assert -1 <= row["expected_cos"] <= 1 + 1e-6 and -1 <= row["realized_cos"] <= 1 + 1e-6
  # Cosines ignore a common scale: rho normalization changes no cosine.
  assert abs(overall["rho normalization"]["delta_expected"]) < 1e-5
  assert abs(overall["rho normalization"]["delta_realized"]) < 1e-5
  # Threshold 0 keeps every prompt (mixed > 0 for 0 < p < 1): the "equalized" allocation.
  for field in ("delta_expected", "delta_realized"):
    assert overall["threshold 0"][field] == pytest.approx(
        overall["no active set (equalized)"][field], abs=1e-6)
  assert {"p: historical (discounted Beta)", "p: pilot 2 rollouts", "p: pilot 4 rollouts",
          "estimator maxrl_plain", "w = 1 (no multiplicity correction)"} <= set(overall)


def test_cli_figure_names_its_choices():
  from sera_jax.harness import cli
  with pytest.raises(SystemExit, match="budget, scale, ablations"):
    cli.main(["figure", "nope"])


def test_tune_then_repeat_tunes_on_the_first_seed_and_repeats_the_chosen_rate():
  trained = []

  def train_one(rate, seed):
    trained.append((rate, seed))
    return {"validation": {0.1: 0.5, 0.2: 0.7, 0.4: float("nan")}[rate], "seed": seed}

  tuned = common.tune_then_repeat(train_one, [0.1, 0.2, 0.4], [3, 5, 7],
                                  lambda run: run["validation"])
  assert tuned.rate == 0.2
  assert trained == [(0.1, 3), (0.2, 3), (0.4, 3), (0.2, 5), (0.2, 7)]
  assert sorted(tuned.grid) == [0.1, 0.2, 0.4] and sorted(tuned.runs) == [3, 5, 7]
  assert tuned.runs[3] is tuned.grid[0.2][3]
  trained.clear()
  scores = {(0.1, 3): 0.5, (0.1, 5): 0.1, (0.2, 3): 0.2, (0.2, 5): 0.3}
  tuned = common.tune_then_repeat(lambda rate, seed: train_one(rate, seed) | {
      "validation": scores.get((rate, seed))}, [0.1, 0.2], [3, 5, 7], lambda run: run["validation"],
                                  num_tuning_seeds=2)
  assert tuned.scores == pytest.approx({0.1: 0.3, 0.2: 0.25}) and tuned.rate == 0.1
  assert trained == [(0.1, 3), (0.1, 5), (0.2, 3), (0.2, 5), (0.1, 7)]
  assert [key for key, _ in common.grid_runs(tuned)] == [(0.1, 3), (0.1, 5), (0.2, 3), (0.2, 5)]
  with pytest.raises(ValueError, match="num_tuning_seeds"):
    common.tune_then_repeat(train_one, [0.1], [3], lambda run: 0.0, num_tuning_seeds=2)
  assert common.choose_rate({0.3: 0.5, 0.1: 0.5, 0.2: 0.4}) == 0.1  # ties: the smaller rate
  assert common.choose_rate({0.1: float("nan"), 0.2: 0.0}) == 0.2  # a diverged run never wins


@pytest.mark.slow
def test_training_outcome_smoke_and_its_cache_refuses_a_run_of_another_config(tmp_path,
                                                                            monkeypatch):
  args = ["--datasets", "digits", "--methods", "sera", "uniform", "--seeds", "0", "1",
          "--num-steps", "digits=4", "--learning-rates", "0.01", "0.1",
          "--workdir-root", str(tmp_path / "runs"), "--out", str(tmp_path)]
  outcome.main(args)
  rows = _read_csv(tmp_path / "training_outcome.csv")
  assert {(r["dataset"], r["method"]) for r in rows} == {("digits", "sera"), ("digits", "uniform")}
  assert {"mean", "std", "ci95", "seed0", "seed1", "learning_rate"} <= set(rows[0])
  assert (tmp_path / "training_outcome.png").stat().st_size > 0
  grid = _read_csv(tmp_path / "training_outcome_rates.csv")
  assert sorted((r["method"], float(r["learning_rate"])) for r in grid) == [
      ("sera", 0.01), ("sera", 0.1), ("uniform", 0.01), ("uniform", 0.1)]
  for method in ("sera", "uniform"):
    best = max((r for r in grid if r["method"] == method),
               key=lambda r: (float(r["validation_pass@1"]), -float(r["learning_rate"])))
    assert [r["chosen"] for r in grid if r["method"] == method].count("True") == 1
    assert best["chosen"] == "True"
    assert {r["learning_rate"] for r in rows if r["method"] == method} == {best["learning_rate"]}
  # Seed 1 trained only at the chosen rate.
  trained = {path.name for path in (tmp_path / "runs" / "digits-4steps").iterdir()}
  assert len(trained) == 2 * 2 + 2
  # A changed default (here the validation split) makes every cached run another config's.
  monkeypatch.setitem(outcome.DATASETS, "digits", outcome.DATASETS["digits"]._replace(
      num_validation=200))
  with pytest.raises(SystemExit, match="different config \\(dataset_kwargs differ\\)"):
    outcome.main(args)


@pytest.mark.slow
def test_maze_figure_smoke_and_its_cache_refuses_a_run_of_another_config(tmp_path, capsys,
                                                                        monkeypatch):
  args = ["--tiny", "--seeds", "2", "--tuning-seeds", "1", "--learning-rates", "3e-4", "1e-3",
          "--methods", "sera", "uniform", "--workdir", str(tmp_path / "runs"),
          "--out", str(tmp_path)]
  maze.main(args)
  grid = _read_csv(tmp_path / "maze_passk_tiny_rates.csv")
  assert sorted((r["method"], float(r["learning_rate"]), r["seed"]) for r in grid) == [
      ("sera", 3e-4, "0"), ("sera", 1e-3, "0"), ("uniform", 3e-4, "0"), ("uniform", 1e-3, "0")]
  for method in ("sera", "uniform"):
    runs = sorted((r for r in grid if r["method"] == method),
                  key=lambda r: (-float(r["validation_pass@16"]), float(r["learning_rate"])))
    assert [r["chosen"] for r in runs] == ["True", "False"]
    # Seed 1 trained only at the chosen rate.
    assert (tmp_path / "runs" / f"{method}-lr{float(runs[0]['learning_rate']):g}-seed1").is_dir()
    assert not (tmp_path / "runs" / f"{method}-lr{float(runs[1]['learning_rate']):g}-seed1"
                ).exists()
  assert (tmp_path / "maze_passk_tiny_rates.png").stat().st_size > 0
  rows = _read_csv(tmp_path / "maze_passk_tiny.csv")
  methods = {r["method"] for r in rows}
  assert methods == {"warm start", "maze-blind", "sera", "uniform", "sera - uniform"}
  assert all(float(r["mean"]) == 0 for r in rows if r["method"] == "maze-blind")
  for r in rows:
    if r["method"] == "sera - uniform":
      sera = next(x for x in rows if x["method"] == "sera" and x["k"] == r["k"])
      uniform = next(x for x in rows if x["method"] == "uniform" and x["k"] == r["k"])
      assert float(r["seed1"]) == pytest.approx(
          float(sera["seed1"]) - float(uniform["seed1"]), abs=2e-4)
  out = capsys.readouterr().out
  assert "share their shortest path" in out and "every method scores 0" in out
  # A changed default makes the cached runs another config's: refused, not read back.
  load_config = maze.load_config
  monkeypatch.setattr(maze, "load_config", lambda tiny: _more_eval_samples(load_config(tiny)))
  with pytest.raises(SystemExit, match="different config \\(eval_samples differ\\)"):
    maze.main(args)


def _more_eval_samples(config):
  config.eval_samples *= 2
  return config


@pytest.mark.slow
def test_math_figure_smoke_reuses_finished_runs_and_refuses_other_settings(tmp_path, capsys,
                                                                          monkeypatch):
  from sera_jax.harness.figures import math as math_figure  # needs the [llm] extra
  args = ["--tiny", "--seeds", "2", "--methods", "sera", "uniform", "--workdir",
          str(tmp_path / "runs"), "--out", str(tmp_path)]
  math_figure.main(args)
  rows = _read_csv(tmp_path / "math_passk_tiny.csv")
  assert {r["method"] for r in rows} == {"warm start", "sera", "uniform", "sera - uniform"}
  value = {(r["method"], r["k"], s): float(r[f"seed{s}"]) for r in rows for s in (0, 1)}
  for (method, k, s), difference in value.items():
    if method == "sera - uniform":
      assert difference == pytest.approx(value["sera", k, s] - value["uniform", k, s], abs=2e-4)
  assert [int(r["k"]) for r in rows if r["method"] == "sera"] == list(math_figure.PASS_AT_K)
  config = math_figure.load_config(tiny=True)
  aligned = _read_csv(tmp_path / "math_alignment_tiny.csv")
  steps = list(range(1, config.rl_steps + 1, config.align_every))
  assert [(r["method"], int(r["seed"]), int(r["step"])) for r in aligned] == [
      (m, s, step) for m in ("sera", "uniform") for s in (0, 1) for step in steps]
  for row in aligned:
    assert all(-1 <= float(row[name]) <= 1 for name in math_figure.ALIGNED[:3])
    assert float(row["exact_log_p/mean"]) < 0
  tuning = _read_csv(tmp_path / "math_tuning_tiny.csv")
  assert {(r["method"], float(r["learning_rate"])) for r in tuning} == {
      (m, rate) for m in ("sera", "uniform") for rate in config.learning_rates}
  assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(
      [f"{m}-seed{s}.json" for m in ("sera", "uniform") for s in (0, 1)]
      + [f"warm-seed{s}.json" for s in (0, 1)]
      + [f"tune-{m}-lr{rate:g}-seed{s}.json" for m in ("sera", "uniform")
         for rate in config.learning_rates for s in config.tuning_seeds])
  first = capsys.readouterr().out
  def train_again(*unused, **kwargs):
    raise AssertionError("a finished run trained again")
  monkeypatch.setattr(math_figure, "warm_start", train_again)
  monkeypatch.setattr(math_figure, "reinforce", train_again)
  math_figure.main(args)  # every run is there: nothing trains again, the same table
  def tables(out):
    return out[out.index("| |"):out.index("total")]
  assert tables(capsys.readouterr().out) == tables(first)
  other = math_figure._run_settings(config, "sera", config.learning_rates[0] * 2)
  with pytest.raises(SystemExit, match="another --workdir"):
    math_figure._cached(tmp_path / "runs" / "sera-seed0.json", other, dict)


def test_math_figure_chooses_each_arms_rate_on_validation_problems(tmp_path, monkeypatch):
  """The best mean validation pass@1 over the tuning seeds wins, a tie goes to the smaller
  rate, and the held-out problems are never evaluated."""
  from sera_jax.harness.figures import math as math_figure
  config = math_figure.load_config(tiny=True)
  config.learning_rates, config.tuning_seeds = (1e-3, 3e-3, 1e-2), (100, 101)
  best = {"sera": 3e-3, "uniform": None}  # uniform: every rate scores the same

  def validation_run(config, problems, model, method, seed, rate, *, evaluate_on):
    assert evaluate_on == "validation"
    score = 0.5 if rate == best[method] else 0.25
    return {"pass_at_k": [score + 0.01 * (seed - 100)], "alignment": {}, "last_counts": []}

  monkeypatch.setattr(math_figure, "reinforce", validation_run)
  chosen = math_figure.choose_learning_rates(config, None, ["sera", "uniform"],
                                             files.path(tmp_path), lambda seed: (None, None),
                                             str(tmp_path / "tuning.csv"))
  assert chosen == {"sera": 3e-3, "uniform": 1e-3}
  assert len(_read_csv(tmp_path / "tuning.csv")) == 2 * 3 * 2


@pytest.mark.slow
def test_budget_scaling_smoke_and_its_cache_refuses_a_run_of_another_config(tmp_path, capsys):
  from sera_jax.harness.figures import scaling
  args = ["--baselines", "2", "4", "--seeds", "0", "1", "--num-steps", "4",
          "--methods", "ce", "uniform", "sera", "--learning-rates", "0.05", "0.2",
          "--workdir-root", str(tmp_path / "runs"), "--out", str(tmp_path)]
  scaling.main([*args, "--eval-every", "2"])
  rows = _read_csv(tmp_path / "budget_scaling.csv")
  assert {(r["N0"], r["method"]) for r in rows} == {
      (n0, m) for n0 in ("2", "4") for m in ("ce", "uniform", "sera")}
  assert sorted({int(r["step"]) for r in rows}) == [2, 4]
  ce = {(r["N0"], r["seed"], r["step"]): r["pass@1"] for r in rows if r["method"] == "ce"}
  assert ce["2", "1", "4"] == ce["4", "1", "4"]  # one ce run per seed, drawn at every N0
  assert (tmp_path / "budget_scaling.png").stat().st_size > 0
  out = capsys.readouterr().out
  assert "sera - uniform" in out and "seed 1:" in out
  assert len(list((tmp_path / "runs" / "4steps").iterdir())) == 3  # ce, N0=2, N0=4
  # Seed 0 at both rates, seed 1 at the chosen one: 3 runs for ce and for each (method, N0).
  assert len(list((tmp_path / "runs" / "4steps" / "N0=2").iterdir())) == 2 * 3
  grid = _read_csv(tmp_path / "budget_scaling_rates.csv")
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
