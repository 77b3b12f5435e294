"""Tests of sera_jax.figures and smoke runs of the figure scripts of experiments/ (issue 4)."""

import argparse
import csv
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sera_jax import classification, figures, success
from sera_jax import config as config_lib
from sera_jax.classification_task import ClassificationTask
from sera_jax.cli import REPO_ROOT

# Batches of 256 digits: 5 steps an epoch, so 10 steps give snapshots at steps 5 and 10.
TINY = ["--num-steps", "10", "--batch-size", "256"]


def _script(name):
  return config_lib.load_module(REPO_ROOT / "experiments" / f"{name}.py")


def _read_csv(path):
  with open(path) as f:
    return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """The workdir of one tiny training run: the first test to use it trains it, and the
  others (each script's `prepare_run`) find it finished."""
  return str(tmp_path_factory.mktemp("figures") / "run")


def test_snapshot_steps():
  assert figures.snapshot_steps(500, 22) == {"early": 22, "mid": 242, "late": 484}
  assert figures.snapshot_steps(10, 5) == {"early": 5, "mid": 5, "late": 10}
  with pytest.raises(ValueError, match="one epoch"):
    figures.snapshot_steps(4, 5)


def test_vmapped_seeds_equal_a_loop_over_seeds():
  config = config_lib.classification()
  config.batch_size = 16
  task = ClassificationTask(config)
  state = task.init_state(jax.random.PRNGKey(0))
  batch = figures.evaluation_batches(task.dataset, 16, 1)[0]
  bounds = dict(baseline_n=4, n_min=2, n_max=16)
  methods = {"sera": figures.oracle_method(mode="sera", **bounds),
             "pilot": figures.pilot_method(2, **bounds)}
  keys = figures.seed_keys(3, 5)
  vmapped = jax.device_get(
      figures.make_evaluator(task, methods)(state, batch.images, batch.labels, keys))

  labels = jnp.asarray(batch.labels)

  def one_seed(method, key):
    """Cosines of one seed, without vmap: its own allocation, sampling and VJPs."""
    forward = lambda p: task.model.apply(p, state.batch_stats, batch.images, train=True)[0]  # noqa: E731
    logits, vjp_fn = jax.vjp(forward, state.params)
    flat = lambda cotangent: jnp.concatenate(  # noqa: E731
        [g.ravel() for g in jax.tree.leaves(vjp_fn(cotangent))])
    cosine = lambda a, b: a @ b / (jnp.linalg.norm(a) * jnp.linalg.norm(b))  # noqa: E731
    exact = flat(classification.exact_logit_grad(logits, labels))
    allocation_key, sample_key = jax.random.split(key)
    alloc = method.allocate(allocation_key, logits, labels, {})
    realized = classification.estimate_logit_grad(
        sample_key, logits, labels, alloc, baseline_n=method.baseline_n,
        max_rollouts=method.max_rollouts)
    expected = classification.expected_logit_grad(
        logits, labels, alloc, baseline_n=method.baseline_n, max_rollouts=method.max_rollouts)
    return cosine(flat(realized), exact), cosine(flat(expected), exact)

  for name, method in methods.items():
    loop = jax.jit(functools.partial(one_seed, method))
    for seed, key in enumerate(keys):
      realized, expected = loop(key)
      np.testing.assert_allclose(vmapped[name].realized[seed], realized, atol=2e-5)
      np.testing.assert_allclose(vmapped[name].expected[seed], expected, atol=2e-5)
  # The oracle allocation does not depend on the seed, so neither does its expected gradient.
  assert np.ptp(vmapped["sera"].expected) == 0


def test_historical_estimate_replays_the_epochs(run_dir):
  args = argparse.ArgumentParser()
  figures.add_run_arguments(args, seeds=None)
  task, workdir, _ = figures.prepare_run(args.parse_args([*TINY, "--workdir", run_dir]))
  estimates = figures.historical_log_p(task, workdir, [5, 10])
  assert set(estimates) == {5, 10}
  for log_p in estimates.values():
    assert log_p.shape == (task.dataset.num_train,)
    assert np.all(np.asarray(log_p) < 0)
  # After one epoch of 8 uniform rollouts a prompt's estimate is (0.5 + S) / (1 + 8).
  successes = np.exp(np.asarray(estimates[5])) * 9 - 0.5
  np.testing.assert_allclose(successes, np.round(successes), atol=1e-4)
  np.testing.assert_allclose(
      success.pilot_log_p(jnp.asarray(np.round(successes)), 8), estimates[5], atol=1e-6)


def test_alignment_vs_budget_smoke(run_dir, tmp_path):
  rows = _script("alignment_vs_budget").main(
      [*TINY, "--workdir", run_dir, "--out", str(tmp_path), "--baselines", "2",
       "--seeds", "3"])
  assert (tmp_path / "alignment_vs_budget.png").stat().st_size > 0
  written = _read_csv(tmp_path / "alignment_vs_budget.csv")
  assert len(written) == len(rows) == 3 * 3  # snapshots x methods
  for row in written:
    for field in ("expected_cos", "realized_cos_mean"):
      assert -1 <= float(row[field]) <= 1 + 1e-6
    assert float(row["realized_cos_ci95_low"]) <= float(row["realized_cos_ci95_high"])
  # At N0 = n_min every prompt gets n_min rollouts: "equalized" is uniform, exactly.
  at_n_min = {(r["snapshot"], r["method"]): r for r in rows if r["N0"] == 2}
  for snapshot in ("early", "mid", "late"):
    for field in ("expected_cos", "realized_cos_mean"):
      assert at_n_min[snapshot, "equalized"][field] == at_n_min[snapshot, "uniform"][field]


def test_scale_equalization_smoke(run_dir, tmp_path):
  rows = _script("scale_equalization").main(
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


def test_ablations_smoke(run_dir, tmp_path):
  rows = _script("ablations").main(
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
  from sera_jax import cli
  with pytest.raises(SystemExit, match="budget, scale, ablations"):
    cli.main(["figure", "nope"])
  assert pathlib.Path(REPO_ROOT / "experiments" / "ablations.py").exists()
