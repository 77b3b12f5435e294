"""The maze figure (`sera-jax figure maze`): a smoke run of its tuned, batched grid, its cache."""

import json

import pytest
from manifests import assert_manifest

from sera_jax.common import files
from sera_jax.harness import batched
from sera_jax.harness.figures import maze


@pytest.mark.slow
def test_maze_figure_smoke_and_its_cache_refuses_a_run_of_another_config(tmp_path, capsys,
                                                                        monkeypatch):
  # Two rates at the tuning seed 100, then seeds 0 and 1 at the chosen rate: both batches of a
  # method are one program (of 2 runs), compiled once.
  args = ["--tiny", "--seeds", "2", "--tuning-seeds", "1", "--learning-rates", "3e-4", "1e-3",
          "--methods", "sera", "uniform", "--workdir", str(tmp_path / "runs"),
          "--out", str(tmp_path)]
  maze.main(args)
  grid = files.read_csv(tmp_path / "maze_passk_tiny_rates.csv")
  assert sorted((r["method"], float(r["learning_rate"]), r["seed"]) for r in grid) == [
      ("sera", 3e-4, "100"), ("sera", 1e-3, "100"), ("uniform", 3e-4, "100"),
      ("uniform", 1e-3, "100")]
  for method in ("sera", "uniform"):
    runs = sorted((r for r in grid if r["method"] == method),
                  key=lambda r: (-float(r["validation_pass@16"]), float(r["learning_rate"])))
    assert [r["chosen"] for r in runs] == ["True", "False"]
    # The reported seeds 0 and 1 trained only at the chosen rate, as one batch.
    chosen, other = (float(run["learning_rate"]) for run in runs)
    outcome = batched.run_outcome(tmp_path / "runs" / f"{method}-lr{chosen:g}-seed0")
    batch = json.loads((files.path(outcome.batch_dir) / batched.RUNS_FILE).read_text())
    assert [files.path(workdir).name for workdir in batch] == [
        f"{method}-lr{chosen:g}-seed{seed}" for seed in (0, 1)]
    assert not (tmp_path / "runs" / f"{method}-lr{other:g}-seed0").exists()
  assert (tmp_path / "maze_passk_tiny_rates.png").stat().st_size > 0
  rows = files.read_csv(tmp_path / "maze_passk_tiny.csv")
  methods = {r["method"] for r in rows}
  assert methods == {"warm start", "maze-blind", "sera", "uniform", "sera - uniform"}
  for r in rows:
    if r["method"] == "sera - uniform":
      sera = next(x for x in rows if x["method"] == "sera" and x["k"] == r["k"])
      uniform = next(x for x in rows if x["method"] == "uniform" and x["k"] == r["k"])
      assert float(r["seed1"]) == pytest.approx(
          float(sera["seed1"]) - float(uniform["seed1"]), abs=2e-4)
  manifest = assert_manifest(tmp_path, "maze_passk_tiny", "figure maze", args, [0, 1], [100])
  assert manifest["protocol"]["shared_warm_start"] and manifest["seeds"] == [0, 1]
  assert manifest["protocol"]["overlaps"] == dict.fromkeys(
      ("sft_rl", "sft_eval", "rl_eval", "held_out_validation"), 0)
  assert (manifest["protocol"]["sft_mazes"], manifest["protocol"]["rl_mazes"]) == (256, 32)
  assert len(list((tmp_path / "runs" / "warm_start").iterdir())) == 1  # one, shared
  # A changed default makes the cached runs another config's: refused, not read back.
  load_config = maze.load_config
  monkeypatch.setattr(maze, "load_config",
                      lambda *args: _more_eval_samples(load_config(*args)))
  with pytest.raises(SystemExit, match="different config \\(eval_samples differ\\)"):
    maze.main(args)
  monkeypatch.undo()
  # So is a run of another maze size: --maze-size reaches every run's config.
  with pytest.raises(SystemExit, match="different config \\(maze_size differ\\)"):
    maze.main(args + ["--maze-size", "11"])


def test_the_maze_size_must_be_odd_and_at_least_5(capsys):
  for size in ("8", "3"):
    with pytest.raises(SystemExit):
      maze.main(["--maze-size", size])
    assert "--maze-size: size must be" in capsys.readouterr().err


def _more_eval_samples(config):
  config.eval_samples *= 2
  return config
