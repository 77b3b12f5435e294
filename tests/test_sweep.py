"""`sera-jax sweep`: grid expansion, printed commands, running a grid, skipping finished runs."""

import os
import shlex
import shutil
import subprocess
import sys

import pytest
from corrupt_checkpoints import corrupt_checkpoint, listing

from sera_jax.harness import batched, cli, sweep, train

TINY = ["--grid", "num_steps=2", "--grid", "batch_size=16", "--grid", "eval_every=0",
        "--grid", "checkpoint_every=100"]


def test_axes_expand_to_the_cartesian_product_in_order(tmp_path):
  axes = [sweep.parse_axis("method=sera,uniform"), sweep.parse_axis("config.seed=0, 1,2")]
  assert axes == [("method", ["sera", "uniform"]), ("seed", ["0", "1", "2"])]
  runs = sweep.expand(axes, str(tmp_path))
  assert [run.overrides for run in runs] == [
      (("method", m), ("seed", s)) for m in ("sera", "uniform") for s in ("0", "1", "2")]
  assert runs[4].workdir == os.path.join(str(tmp_path), "method=uniform,seed=1")
  assert sweep.workdir_name([("dataset_kwargs.data_dir", "/data/x")]) == \
      "dataset_kwargs.data_dir=_data_x"


@pytest.mark.parametrize("specs,message", [
    (["method"], "KEY=V1,V2"), (["method=sera,"], "no empty"), (["=1"], "no empty"),
    (["seed=1,1"], "repeats"), (["seed=1", "seed=2"], "seed more than once"),
])
def test_bad_grids_are_rejected(tmp_path, specs, message):
  with pytest.raises((ValueError, SystemExit), match=message):
    sweep.expand([sweep.parse_axis(spec) for spec in specs], str(tmp_path))


def test_print_commands_gives_one_train_command_per_run(tmp_path, capsys):
  root = str(tmp_path / "sweeps")
  cli.main(["sweep", "--grid", "method=sera,uniform", "--grid", "seed=0,1,2",
            "--workdir-root", root, "--print-commands"])
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 6
  first = shlex.split(lines[0])
  assert first == ["sera-jax", "train", "--config=default", "--config.method=sera",
                   "--config.seed=0", f"--workdir={root}/method=sera,seed=0"]
  assert shlex.split(lines[5])[3:5] == ["--config.method=uniform", "--config.seed=2"]
  assert not os.path.exists(root)


def test_an_unknown_key_fails_before_any_run(tmp_path):
  with pytest.raises(SystemExit, match=r"--config\.batchsize: the config has no key 'batchsize'"):
    cli.main(["sweep", "--grid", "batchsize=8", "--workdir-root", str(tmp_path)])
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize("grid, message", [
    (["seed=-1,0"], r"seed=-1: config\.seed must be >= 0; got -1\.$"),
    (["method=sera,foo"], r"method=foo: config\.method must be one of .*; got 'foo'"),
    (["num_steps=2", "checkpoint_every=0"], r"config\.checkpoint_every must be >= 1"),
])
def test_every_runs_values_are_checked_before_the_first_run(tmp_path, grid, message):
  """A bad value in the last run of the grid stops the sweep before the first run trains."""
  with pytest.raises(SystemExit, match=message):
    cli.main(["sweep", *(arg for spec in grid for arg in ("--grid", spec)), "--workdir-root",
              str(tmp_path)])
  assert not os.listdir(tmp_path)


def test_a_config_the_loop_does_not_train_is_refused(tmp_path):
  with pytest.raises(SystemExit, match=r"^error: sera-jax sweep trains configs of the "
                                       r"classification, maze and sim settings; gsm8k_qwen3's task "
                                       r"is 'gsm8k' \(train it with sera-jax train, one run at "
                                       r"a time\)\.$"):
    cli.main(["sweep", "--config", "gsm8k_qwen3", "--grid", "seed=0,1", "--print-commands",
              "--workdir-root", str(tmp_path)])
  assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_sweep_runs_the_grid_and_skips_finished_runs(tmp_path, capsys):
  root = str(tmp_path)
  cli.main(["sweep", "--grid", "seed=0", *TINY, "--workdir-root", root])
  grid = ["--grid", "seed=0,1", *TINY, "--workdir-root", root]
  done, todo = sweep.expand([sweep.parse_axis(s) for s in ("seed=0,1", *TINY[1::2])], root)
  assert [row["step"] for row in train.read_metrics(done.workdir)] == [0, 1]
  assert sweep.is_done(done.workdir, 2) and not sweep.is_done(todo.workdir, 2)
  capsys.readouterr()

  trained = []
  sweep.main(grid, trained.append)
  assert f"skip {done.workdir}" in capsys.readouterr().out
  assert trained == [todo.train_args("default")]
  shutil.rmtree(os.path.join(done.workdir, "checkpoints", "2"))  # killed before the last save
  assert not sweep.is_done(done.workdir, 2)


@pytest.mark.slow
def test_a_batch_whose_checkpoint_is_corrupt_stops_the_sweep_and_its_advice_resumes(tmp_path):
  grid = ["sweep", "--grid", "seed=0,1", "--grid", "num_steps=6", "--grid", "batch_size=16",
          "--grid", "eval_every=0", "--grid", "checkpoint_every=2", "--workdir-root",
          str(tmp_path)]
  cli.main(grid)
  workdirs = [run.workdir for run in sweep.expand(
      [sweep.parse_axis(spec) for spec in grid[2:-2:2]], str(tmp_path))]
  whole = [train.read_metrics(workdir) for workdir in workdirs]
  for workdir in workdirs:  # as a batch killed before it marked its runs finished
    os.remove(os.path.join(workdir, batched.OUTCOME_FILE))
  batch_dir, = tmp_path.glob("batch-*")
  corrupt_checkpoint(batch_dir, 6)
  before = listing(tmp_path)
  resumed = subprocess.run([sys.executable, "-m", "sera_jax.harness.cli", *grid],
                           capture_output=True, text=True, timeout=600)
  assert resumed.returncode == 1, resumed.stderr[-2000:]
  # One line, whole, whatever TensorStore's abandoned reads print around it (as `train`'s).
  message = (
      f"error: the checkpoint of step 6 in {batch_dir}/checkpoints/6 cannot be restored: it is "
      f"corrupt or incomplete. Nothing in {batch_dir} was changed; to go on, move "
      f"{batch_dir}/checkpoints/6 out of {batch_dir}/checkpoints to resume from step 4, the "
      f"latest earlier checkpoint kept, or start over: delete {batch_dir} and the workdirs its "
      f"runs.json lists.\n")
  assert resumed.stderr.count(message) == 1, resumed.stderr
  assert "sera_jax/harness/" not in resumed.stderr, resumed.stderr
  assert listing(tmp_path) == before
  (batch_dir / "checkpoints" / "6").rename(tmp_path / "corrupt-6")
  cli.main(grid)
  assert [train.read_metrics(workdir) for workdir in workdirs] == whole


@pytest.mark.slow
def test_a_run_stopped_non_finite_in_its_batch_is_done_and_skipped(tmp_path, capsys):
  """The batch stops a run whose state goes non-finite and trains the others to the end; the
  sweep run again skips both, the stopped one with its step, instead of training it alone."""
  grid = ["sweep", "--grid", "learning_rate=0.01,1e38", "--grid", "num_steps=4", "--grid",
          "batch_size=16", "--grid", "eval_every=0", "--grid", "checkpoint_every=1",
          "--workdir-root", str(tmp_path)]
  cli.main(grid)
  finished, stopped = sweep.expand([sweep.parse_axis(spec) for spec in grid[2:-2:2]],
                                   str(tmp_path))
  stopped_at = batched.run_outcome(stopped.workdir).stopped_at
  assert stopped_at is not None and batched.run_outcome(finished.workdir).stopped_at is None
  assert sweep.is_done(stopped.workdir, 4) and sweep.is_done(finished.workdir, 4)
  capsys.readouterr()
  trained = []
  sweep.main(grid[1:], trained.append)
  out = capsys.readouterr().out
  assert not trained and f"skip {finished.workdir}: finished (4 steps)" in out
  assert f"skip {stopped.workdir}: stopped at step {stopped_at}, non-finite" in out


@pytest.mark.slow
def test_a_run_goes_on_only_as_it_was_trained_batched_or_alone(tmp_path):
  """Rows of a run trained batched and then alone (or the other way) would splice two
  trajectories: a run of an unfinished batch is refused alone, and a run trained alone is
  refused in a batch, each with the way to go on; the batch then finishes as it would."""
  root = str(tmp_path / "batched")
  grid = ["sweep", "--grid", "seed=0,1", *TINY, "--workdir-root", root]
  cli.main(grid)
  workdirs = [run.workdir for run in sweep.expand(
      [sweep.parse_axis(spec) for spec in grid[2:-2:2]], root)]
  whole = [train.read_metrics(workdir) for workdir in workdirs]
  for workdir in workdirs:  # as a batch killed before it marked its runs finished
    os.remove(os.path.join(workdir, batched.OUTCOME_FILE))
  batch_dir = train.batch_of(workdirs[0])
  with pytest.raises(SystemExit, match=f"^error: {workdirs[0]} holds a run of the batch in "
                                       f"{batch_dir}, whose checkpoints hold its state"):
    cli.main([*grid, "--one-by-one"])
  cli.main(grid)
  assert [train.read_metrics(workdir) for workdir in workdirs] == whole

  root = str(tmp_path / "alone")
  cli.main(["sweep", "--grid", "seed=0", *TINY, "--workdir-root", root, "--one-by-one"])
  alone, = sweep.expand([sweep.parse_axis(spec) for spec in ("seed=0", *TINY[1::2])], root)
  shutil.rmtree(os.path.join(alone.workdir, "checkpoints", "2"))  # killed before its last save
  with pytest.raises(SystemExit, match=f"^error: {alone.workdir} holds the rows of a run "
                                       f"trained alone, not of this batch"):
    cli.main(["sweep", "--grid", "seed=0,1", *TINY, "--workdir-root", root])
