"""The math figure (`sera-jax figure math`, needs the [llm] extra): a smoke run, its cache and
its choice of each arm's learning rate."""

import pytest
from manifests import assert_manifest

from sera_jax.common import files


@pytest.mark.slow
def test_math_figure_smoke_reuses_finished_runs_and_refuses_other_settings(tmp_path, capsys,
                                                                          monkeypatch):
  from sera_jax.harness.figures import math as math_figure  # needs the [llm] extra
  args = ["--tiny", "--seeds", "2", "--methods", "sera", "uniform", "--workdir",
          str(tmp_path / "runs"), "--out", str(tmp_path)]
  math_figure.main(args)
  rows = files.read_csv(tmp_path / "math_passk_tiny.csv")
  protocol = assert_manifest(tmp_path, "math_passk_tiny", "figure math", args, [0, 1], [100])[
      "protocol"]
  assert protocol["learning_rates"]["chosen"] == {"sera": 1e-3, "uniform": 1e-3}
  assert {r["method"] for r in rows} == {"warm start", "sera", "uniform", "sera - uniform"}
  value = {(r["method"], r["k"], s): float(r[f"seed{s}"]) for r in rows for s in (0, 1)}
  for (method, k, s), difference in value.items():
    if method == "sera - uniform":
      assert difference == pytest.approx(value["sera", k, s] - value["uniform", k, s], abs=2e-4)
  assert [int(r["k"]) for r in rows if r["method"] == "sera"] == list(math_figure.PASS_AT_K)
  config = math_figure.load_config(tiny=True)
  aligned = files.read_csv(tmp_path / "math_alignment_tiny.csv")
  steps = list(range(1, config.rl_steps + 1, config.align_every))
  assert [(r["method"], int(r["seed"]), int(r["step"])) for r in aligned] == [
      (m, s, step) for m in ("sera", "uniform") for s in (0, 1) for step in steps]
  for row in aligned:
    assert all(-1 <= float(row[name]) <= 1 for name in math_figure.ALIGNED[:3])
    assert float(row["exact_log_p/mean"]) < 0
  # --tiny's grid is one rate: nothing to choose, so no tuning run (the choice among several
  # is the next test's).
  assert config.learning_rates == (1e-3,) and not (tmp_path / "math_tuning_tiny.csv").exists()
  assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(
      [f"{m}-seed{s}.json" for m in ("sera", "uniform") for s in (0, 1)]
      + [f"warm-seed{s}.json" for s in (0, 1)])
  first = capsys.readouterr().out
  assert "one learning rate, 0.001: no tuning runs" in first
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
  assert len(files.read_csv(tmp_path / "tuning.csv")) == 2 * 3 * 2
