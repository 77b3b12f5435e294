"""Tests of the figure experiments (sera_jax.harness.figures) and the alignment evaluator."""

import argparse
import json

import jax.numpy as jnp
import numpy as np
import pytest
from manifests import assert_manifest

from sera_jax.common import files
from sera_jax.harness import batched, train
from sera_jax.harness.figures import ablations, budget, common, outcome, scale
from sera_jax.method import success

# Batches of 256 digits: 5 steps an epoch, so 10 steps give snapshots at steps 5 and 10.
TINY = ["--num-steps", "10", "--batch-size", "256"]


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
  argv = [*TINY, "--workdir", run_dir, "--out", str(tmp_path), "--baselines", "2",
          "--seeds", "3"]
  rows = budget.main(argv)
  assert (tmp_path / "alignment_vs_budget.png").stat().st_size > 0
  manifest = assert_manifest(tmp_path, "alignment_vs_budget", "figure budget", argv, [0, 1, 2], [])
  assert manifest["protocol"]["baselines"] == [2] and manifest["protocol"]["run_method"] == "ce"
  written = files.read_csv(tmp_path / "alignment_vs_budget.csv")
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
  argv = [*TINY, "--workdir", run_dir, "--out", str(tmp_path)]
  rows = scale.main(argv)
  assert (tmp_path / "scale_equalization.png").stat().st_size > 0
  assert assert_manifest(tmp_path, "scale_equalization", "figure scale", argv, [], [])["protocol"][
      "snapshots"].keys() == {"early", "mid", "late"}
  assert len(files.read_csv(tmp_path / "scale_equalization.csv")) == len(rows) == 3 * 256
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
  argv = [*TINY, "--workdir", run_dir, "--out", str(tmp_path), "--batches", "1", "--seeds", "3"]
  rows = ablations.main(argv)
  assert (tmp_path / "ablations.png").stat().st_size > 0
  manifest = assert_manifest(tmp_path, "ablations", "figure ablations", argv, [0, 1, 2], [])
  assert manifest["protocol"]["batches"] == 1
  assert len(files.read_csv(tmp_path / "ablations.csv")) == len(rows)
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


@pytest.mark.parametrize("args, message", [
    (["--num-steps", "5"], r"^error: a run of 5 steps does not finish one epoch of \d+ steps; "
                           r"train longer\.$"),
    (["--config", "maze"], r"^error: --config maze: this figure evaluates a run of the "
                           r"classification setting; the config's task is 'maze'\.$"),
])
def test_a_snapshot_figure_refuses_a_run_it_cannot_evaluate_before_training(tmp_path, args,
                                                                           message):
  from sera_jax.harness import cli
  with pytest.raises(SystemExit, match=message):
    cli.main(["figure", "scale", *args, "--workdir", str(tmp_path / "run"), "--out",
              str(tmp_path / "out")])
  assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["outcome", "scaling", "math", "maze"])
def test_a_figures_help_describes_it_in_whole_sentences(name, capsys):
  from sera_jax.harness import cli
  with pytest.raises(SystemExit):
    cli.main(["figure", name, "--help"])
  description = capsys.readouterr().out.split("\n\n")[1]
  assert description.rstrip().endswith("."), description


def test_tune_then_repeat_tunes_on_its_own_seeds_and_reports_the_others_at_the_chosen_rate():
  batches = []

  def train_grid(points, scores=None):
    batches.append(list(points))
    return [{"validation": (scores or {}).get(
        (rate, seed), {0.1: 0.5, 0.2: 0.7, 0.4: float("nan")}[rate]), "seed": seed}
        for rate, seed in points]

  tuned = common.tune_then_repeat(train_grid, [0.1, 0.2, 0.4], [3, 5, 7],
                                  lambda run: run["validation"], tuning_seeds=[100])
  assert tuned.rate == 0.2
  # The tuning grid as one batch, then every reported seed at the chosen rate as another.
  assert batches == [[(0.1, 100), (0.2, 100), (0.4, 100)], [(0.2, 3), (0.2, 5), (0.2, 7)]]
  assert sorted(tuned.grid) == [0.1, 0.2, 0.4] and sorted(tuned.runs) == [3, 5, 7]
  assert tuned.runs[7]["seed"] == 7
  batches.clear()
  scores = {(0.1, 100): 0.5, (0.1, 101): 0.1, (0.2, 100): 0.2, (0.2, 101): 0.3}
  tuned = common.tune_then_repeat(lambda points: train_grid(points, scores), [0.1, 0.2],
                                  [3], lambda run: run["validation"],
                                  tuning_seeds=common.tuning_seeds(2))
  assert tuned.scores == pytest.approx({0.1: 0.3, 0.2: 0.25}) and tuned.rate == 0.1
  assert batches == [[(0.1, 100), (0.1, 101), (0.2, 100), (0.2, 101)], [(0.1, 3)]]
  assert [key for key, _ in common.grid_runs(tuned)] == [(0.1, 100), (0.1, 101), (0.2, 100),
                                                         (0.2, 101)]
  with pytest.raises(ValueError, match=r"seeds \[100\] both tune and are reported"):
    common.tune_then_repeat(train_grid, [0.1], [3, 100], lambda run: 0.0, tuning_seeds=[100])
  with pytest.raises(ValueError, match="tuning_seeds must hold at least one seed"):
    common.tune_then_repeat(train_grid, [0.1], [3], lambda run: 0.0, tuning_seeds=[])
  assert common.choose_rate({0.3: 0.5, 0.1: 0.5, 0.2: 0.4}) == 0.1  # ties: the smaller rate
  assert common.choose_rate({0.1: float("nan"), 0.2: 0.0}) == 0.2  # a diverged run never wins


def test_a_tuning_runs_held_out_score_is_biased_by_the_choice_it_won():
  """Why the tuning seeds are not reported: four rates of equal quality, each run's luck shared
  by its validation and held-out scores. The held-out score of the tuning run whose
  validation won exceeds a fresh seed's at the chosen rate by about 1.03 sigma (the mean of
  the largest of 4 normals), where the fresh seed's is unbiased."""
  rng = np.random.default_rng(0)
  won, fresh = [], []
  for _ in range(2000):
    def train_grid(points):
      return [{"luck": rng.normal(0.0, 0.05)} for _ in points]

    tuned = common.tune_then_repeat(train_grid, [0.1, 0.2, 0.4, 0.8], [0],
                                    lambda run: run["luck"] + rng.normal(0.0, 0.01),
                                    tuning_seeds=[100])
    won.append(tuned.grid[tuned.rate][100]["luck"])
    fresh.append(tuned.runs[0]["luck"])
  assert np.mean(won) > 0.045 and abs(np.mean(fresh)) < 0.004


@pytest.mark.parametrize("one_by_one, batches", [(False, [[1, 2]]), (True, [[1], [2]])])
def test_a_grid_trains_as_one_batch_or_one_by_one(tmp_path, monkeypatch, one_by_one, batches):
  """Runs done earlier are read back; the rest train as one batch, or each alone."""
  configs = [outcome.run_config("digits", "sera", seed, 2, 0.01) for seed in range(3)]
  workdirs = [str(tmp_path / f"seed{seed}") for seed in range(3)]
  trained = []

  def run_batch(configs_, workdirs_):
    trained.append([workdirs.index(workdir) for workdir in workdirs_])
    for workdir in workdirs_:
      files.write_text(files.path(workdir) / batched.OUTCOME_FILE, json.dumps(
          batched.RunOutcome("batch", 2, None)._asdict()))
    return [[{"step": 0}, {"step": 1}] for _ in workdirs_]

  monkeypatch.setattr(batched, "run_batch", run_batch)
  monkeypatch.setattr(common, "refuse_other_config", lambda config, workdir: None)
  run_batch(configs[:1], workdirs[:1])  # seed 0 finished earlier
  trained.clear()
  monkeypatch.setattr(train, "read_metrics", lambda workdir: [{"step": 0}, {"step": 1}])
  runs = common.train_or_read_batch(configs, workdirs, ["a", "b", "c"], one_by_one=one_by_one)
  assert trained == batches
  assert [run.rows for run in runs] == [[{"step": 0}, {"step": 1}]] * 3
  assert all(run.stopped_at is None for run in runs)


@pytest.mark.slow
def test_training_outcome_smoke_and_its_cache_refuses_a_run_of_another_config(tmp_path,
                                                                            monkeypatch):
  args = ["--datasets", "digits", "--methods", "sera", "uniform", "--seeds", "0", "1",
          "--num-steps", "digits=4", "--learning-rates", "0.01", "0.1",
          "--workdir-root", str(tmp_path / "runs"), "--out", str(tmp_path)]
  outcome.main(args)
  rows = files.read_csv(tmp_path / "training_outcome.csv")
  protocol = assert_manifest(tmp_path, "training_outcome", "figure outcome", args, [0, 1], [100])[
      "protocol"]
  assert protocol["num_steps"] == {"digits": 4}
  assert protocol["learning_rates"]["digits/sera"]["validation"].keys() == {"0.01", "0.1"}
  assert {(r["dataset"], r["method"]) for r in rows} == {("digits", "sera"), ("digits", "uniform")}
  assert {"mean", "std", "ci95", "seed0", "seed1", "learning_rate"} <= set(rows[0])
  assert (tmp_path / "training_outcome.png").stat().st_size > 0
  grid = files.read_csv(tmp_path / "training_outcome_rates.csv")
  assert sorted((r["method"], float(r["learning_rate"])) for r in grid) == [
      ("sera", 0.01), ("sera", 0.1), ("uniform", 0.01), ("uniform", 0.1)]
  for method in ("sera", "uniform"):
    best = max((r for r in grid if r["method"] == method),
               key=lambda r: (float(r["validation_pass@1"]), -float(r["learning_rate"])))
    assert [r["chosen"] for r in grid if r["method"] == method].count("True") == 1
    assert best["chosen"] == "True"
    assert {r["learning_rate"] for r in rows if r["method"] == method} == {best["learning_rate"]}
  # The tuning seed at both rates, seeds 0 and 1 only at the chosen one; each method's two
  # batches beside its runs.
  trained = [path.name for path in (tmp_path / "runs" / "digits-4steps").iterdir()]
  assert len([name for name in trained if not name.startswith("batch-")]) == 2 * (2 + 2)
  assert {name.rpartition("seed=")[2] for name in trained if "lr=" in name} == {"0", "1", "100"}
  assert len([name for name in trained if name.startswith("batch-")]) == 2 * 2
  # A changed default (here the validation split) makes every cached run another config's.
  monkeypatch.setitem(outcome.DATASETS, "digits", outcome.DATASETS["digits"]._replace(
      num_validation=200))
  with pytest.raises(SystemExit, match="different config \\(dataset_kwargs differ\\)"):
    outcome.main(args)


def test_a_csv_reads_back_every_field_as_written(tmp_path):
  rows = [{"a": "x\ry", "b": "1"}, {"a": "p\r\nq", "b": "two, quoted"}, {"a": "", "b": "\n"}]
  files.write_csv(tmp_path / "rows.csv", rows)
  assert files.read_csv(tmp_path / "rows.csv") == rows


def test_a_pass_at_k_csv_reads_back_as_the_results_it_was_written_from(tmp_path):
  seeds, ks = [0, 3], [1, 2, 4]
  results = {"warm start": {0: [0.1, 0.2, 0.3], 3: [0.0, 0.05, 0.1]},
             "sera": {0: [0.25, 0.5, 0.75], 3: [0.125, 0.25, 0.5]},
             "uniform": {0: [0.2, 0.4, 0.6], 3: [0.1, 0.2, 0.4]}}
  path = str(tmp_path / "passk.csv")
  common.write_pass_at_k_csv(results, seeds, ks, path, exclude=["warm start"])
  assert any(common.DIFFERENCE in row["method"] for row in files.read_csv(path))
  assert common.read_pass_at_k_csv(path) == (results, seeds, ks)


def test_a_csv_of_differences_alone_is_refused(tmp_path):
  path = tmp_path / "passk.csv"
  files.write_csv(path, [{"method": "sera - uniform", "k": 1, "seed0": 0.1}])
  with pytest.raises(ValueError, match="no method's pass@k"):
    common.read_pass_at_k_csv(str(path))


@pytest.mark.parametrize("methods, paired", [(["warm start", "grpo"], False),
                                             (["warm start", "grpo", "uniform"], True)])
def test_pass_at_k_outputs_show_paired_differences_only_when_there_are_some(
    tmp_path, recwarn, methods, paired):
  seeds, ks = [0, 1], [1, 2]
  results = {method: {seed: [0.1 * seed + 0.01 * i, 0.2 + 0.01 * i] for seed in seeds}
             for i, method in enumerate(methods)}
  tables = common.pass_at_k_tables(results, seeds, ks, exclude=["warm start"])
  assert ("grpo - uniform" in tables) == ("paired by seed" in tables) == paired
  common.plot_pass_at_k(results, seeds, ks, str(tmp_path / "passk.png"), title="t",
                        what="mazes", exclude=["warm start"])
  assert (tmp_path / "passk.png").exists()
  assert not [w for w in recwarn if "legend" in str(w.message)]  # no empty panel


def test_figure_list_names_each_figure_its_cost_and_its_manifests_date(tmp_path, monkeypatch,
                                                                      capsys):
  from sera_jax.harness import cli
  monkeypatch.chdir(tmp_path)
  common.write_manifest(common.OUT_DIR, scale.NAME, common.start_figure(), command="figure scale",
                        argv=[], seeds=[], tuning_seeds=[], protocol={"snapshots": {}})
  cli.main(["figure", "--list"])
  lines = capsys.readouterr().out.splitlines()
  assert [line.split()[0] for line in lines] == list(cli.FIGURES)
  listed = dict(zip(cli.FIGURES, lines, strict=True))
  manifest = common.read_manifest(common.OUT_DIR, scale.NAME)
  assert scale.CPU_COST in listed["scale"] and f"made {manifest['made_at']}" in listed["scale"]
  assert listed["budget"].endswith("no manifest in docs/figures")
  assert listed["maze"].endswith("no manifest in docs/figures/maze")
