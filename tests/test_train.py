"""The training loop end to end: CLI, outputs, resume after SIGKILL, bad input, ImageNet config."""

import collections
import json
import os
import shutil
import signal
import subprocess
import sys

import gcs_double
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorflow_datasets as tfds
from corrupt_checkpoints import corrupt_checkpoint, listing
from etils.epath import gpath

from sera_jax.common import files, sharding
from sera_jax.common.tf import tensorflow
from sera_jax.harness import cli, configs, sweep, train
from sera_jax.harness.configs.base import classification as base_config
from sera_jax.harness.figures import maze as figure_maze
from sera_jax.settings.classification.task import validate_config

TINY = ["--config.num_steps=6", "--config.eval_every=3", "--config.checkpoint_every=2",
        "--config.batch_size=16"]


def _cli(*args, env=None):
  return subprocess.run([sys.executable, "-m", "sera_jax.harness.cli", *args], capture_output=True,
                        text=True, env=env, timeout=600)


@pytest.mark.parametrize("args, message", [
    (["--config.bogus=1"], r"^error: --config\.bogus: the config has no key 'bogus'\.$"),
    (["--config.dataset_kwargs.bogus=3"],
     r"^error: --config\.dataset_kwargs\.bogus: the config has no key 'dataset_kwargs\.bogus'"),
    (["--config", "maze", "--config.bogus", "3"], r"^error: --config\.bogus: the config has no"),
    (["--num_processes=2"], r"^error: --num_processes: settings of a multi-host job, given "
                            r"without --multihost\.$"),
    (["--multihost"], r"^error: --multihost: coordinator_address should be defined\.$"),
])
def test_bad_train_arguments_end_with_one_line_before_anything_is_written(tmp_path, monkeypatch,
                                                                          args, message):
  def no_cluster(*unused):  # jax.distributed.initialize's error where it detects no cluster
    raise ValueError("coordinator_address should be defined.")

  monkeypatch.setattr(sharding, "initialize_distributed", no_cluster)
  with pytest.raises(SystemExit, match=message):
    cli.main(["train", *args, f"--workdir={tmp_path}/run"])
  assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_train_writes_every_output(tmp_path):
  workdir = str(tmp_path / "run")
  cli.main(["train", f"--workdir={workdir}", *TINY])
  rows = train.read_metrics(workdir)
  assert [r["step"] for r in rows] == list(range(6))
  for name in ("cos/sera_realized", "cos/sera_expected", "cos/uniform_realized",
               "cos/uniform_expected", "cos/sera_vs_uniform", "norm_ratio/sera_expected",
               "rollouts/min", "rollouts/max", "rollouts/std", "active_fraction",
               "useful_group_fraction", "all_zero_group_fraction", "p/mean", "p/q50",
               "kappa/spread", "loss", "cross_entropy", "accuracy"):
    assert all(np.isfinite(r[name]) for r in rows), name
  assert "pass@1024" in rows[2] and "pass@1" in rows[5] and "pass@1" not in rows[0]
  assert sum(r["rollouts/max"] > 8 for r in rows) > 0  # SERA spends unevenly
  assert os.path.getsize(os.path.join(workdir, "alignment.png")) > 10_000
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(f"{workdir}/tensorboard"))
  assert sorted(os.listdir(f"{workdir}/checkpoints")) == ["4", "6"]


@pytest.mark.slow
def test_align_every_skips_the_alignment_metrics(tmp_path):
  workdir = str(tmp_path / "run")
  cli.main(["train", f"--workdir={workdir}", *TINY, "--config.align_every=3",
            "--config.method=uniform"])
  rows = train.read_metrics(workdir)
  assert ["cos/sera_expected" in r for r in rows] == [True, False, False, True, False, False]
  assert all(r["rollouts/max"] == r["rollouts/min"] == 8 for r in rows)


# Runs `sera-jax train ARGS...` under the bucket double served from ROOT and SIGKILLs itself
# as step KILL_AT begins, once Orbax lists the checkpoint of step KILL_AT - 1 in the workdir as
# finalised (on a bucket: its commit file written).
_SIGKILL_IN_STEP = """
import os, signal, sys, time
import gcs_double
import orbax.checkpoint as ocp
from sera_jax.common import files
from sera_jax.harness import cli, train

root, kill_at, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
workdir = next(arg.split("=", 1)[1] for arg in args if arg.startswith("--workdir="))
build_task = train.build_task

def killed_in_step(config):
  task = build_task(config)
  train_step = task.train_step

  def step_or_die(state, step):
    if step == kill_at:
      checkpoints = files.path(workdir) / train.CHECKPOINT_DIR
      while kill_at - 1 not in ocp.path.step.checkpoint_steps(checkpoints):
        time.sleep(0.01)
      os.kill(os.getpid(), signal.SIGKILL)
    return train_step(state, step)
  task.train_step = step_or_die
  return task

train.build_task = killed_in_step
with gcs_double.serve(root):
  cli.main(args)
"""


@pytest.mark.slow
def test_a_bucket_run_killed_resumed_plotted_and_skipped_by_sweep(tmp_path, monkeypatch):
  """gs:// served by a filesystem double (tests/gcs_double.py) through the code a bucket uses.

  The sweep's one run trains into the bucket and is SIGKILLed as step 7 begins, after the
  checkpoint of step 6 (a point the run observes, not a time), then resumed; its rows equal
  an uninterrupted local run's, `sera-jax plot` reads it and writes into the bucket, and the
  sweep then skips it as finished. Nothing lands in the current directory.
  """
  root, cwd = str(tmp_path / "storage"), tmp_path / "cwd"
  cwd.mkdir()
  monkeypatch.chdir(cwd)
  grid = [arg for key in ("num_steps=12", "checkpoint_every=3", "eval_every=4", "batch_size=16")
          for arg in ("--grid", key)] + ["--workdir-root", "gs://bucket/sweep"]
  (run,) = sweep.expand([sweep.parse_axis(spec) for spec in grid[1:-2:2]], "gs://bucket/sweep")
  args = run.train_args("default")
  reference = str(tmp_path / "reference")
  under_double = [sys.executable, gcs_double.__file__, root, "train"]
  uninterrupted = subprocess.Popen([*under_double, *args[:-1], f"--workdir={reference}"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  killed = subprocess.run([sys.executable, "-c", _SIGKILL_IN_STEP, root, "7", "train", *args],
                          cwd=os.path.dirname(__file__), capture_output=True, text=True,
                          timeout=600)
  assert killed.returncode == -signal.SIGKILL, f"not killed in step 7:\n{killed.stderr[-2000:]}"
  with gcs_double.serve(root):
    # Rows up to the checkpoint were flushed with it; the kill lost nothing before it.
    assert [row["step"] for row in train.read_metrics(run.workdir)][:6] == list(range(6))
    assert not (files.path(run.workdir) / train.CHECKPOINT_DIR / "9").exists()
  resumed = subprocess.run([*under_double, *args, "--resume"], capture_output=True, text=True,
                           timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert uninterrupted.wait(timeout=600) == 0
  with gcs_double.serve(root):
    assert train.read_metrics(run.workdir) == train.read_metrics(reference)
    workdir = files.path(run.workdir)
    assert str(workdir).startswith("gs://bucket/sweep/")
    assert {path.name for path in workdir.iterdir()} == {
        "metrics", "config.json", "checkpoints", "tensorboard", "alignment.png"}
    assert (workdir / "checkpoints" / "12").is_dir()
    assert len(list((workdir / "tensorboard").iterdir())) == 2  # one event file per leg
    cli.main(["plot", run.workdir, "--out", "gs://bucket/figures/run.png"])
    assert (files.path("gs://bucket/figures/run.png").stat().length > 10_000
            and files.path("gs://bucket/figures/run.csv").exists())
    trained = []
    sweep.main(grid, trained.append)
    assert trained == []  # finished: skipped
  assert (tmp_path / "storage" / "bucket" / "sweep").is_dir()  # the double's bucket got it all
  assert not list(cwd.iterdir())


@pytest.mark.parametrize("args,message", [
    (["--config.batchsize=3"], "batchsize"),
    # Each case is a subprocess; the fast tier keeps one, the in-process checks cover the rest.
    pytest.param(["--config.n_min=9"], "n_min must be <= baseline_n", marks=pytest.mark.slow),
    pytest.param(["--config.n_max=4"], "baseline_n must be <= n_max", marks=pytest.mark.slow),
    pytest.param(["--config.method=ppo"], "config.method must be one of",
                 marks=pytest.mark.slow),
])
def test_bad_config_is_rejected_before_compiling(tmp_path, args, message):
  result = _cli("train", f"--workdir={tmp_path}/run", *args)
  assert result.returncode != 0
  assert message in result.stderr + result.stdout
  assert not os.path.exists(f"{tmp_path}/run/checkpoints")


def test_batch_not_divisible_by_the_devices():
  config = base_config()
  config.batch_size = 12
  with pytest.raises(ValueError, match="divisible by the device count.*12.*8 devices"):
    validate_config(config, num_devices=8)


@pytest.mark.slow
def test_resume_without_checkpoint_and_changed_config(tmp_path):
  result = _cli("train", f"--workdir={tmp_path}/none", "--resume", *TINY)
  assert result.returncode != 0 and "no checkpoint" in result.stderr
  assert not (tmp_path / "none").exists()  # refused before anything is created
  assert _cli("train", f"--workdir={tmp_path}/run", *TINY).returncode == 0
  changed = _cli("train", f"--workdir={tmp_path}/run", *TINY, "--config.method=uniform")
  assert changed.returncode != 0 and "method" in changed.stderr


@pytest.mark.slow
def test_non_finite_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
  config = base_config()
  config.update(method="ce", learning_rate=1e30, warmup_steps=0, schedule="constant",
                num_steps=8, checkpoint_every=1, eval_every=0, batch_size=16)
  with pytest.raises(train.NonFiniteError, match=r"at step (\d+).*last good checkpoint"):
    train.run(config, str(tmp_path))
  rows = train.read_metrics(str(tmp_path))
  saved = sorted(int(s) for s in os.listdir(tmp_path / "checkpoints"))
  assert saved and saved[-1] == len(rows) < 8


@pytest.mark.slow
def test_imagenet_config_missing_data_dir(tmp_path):
  result = _cli("train", "--config=imagenet_resnet50", f"--workdir={tmp_path}/r",
                f"--config.dataset_kwargs.data_dir={tmp_path}/nothing")
  assert result.returncode != 0
  assert "downloads/manual" in result.stderr and "tfds build imagenet2012" in result.stderr


@pytest.mark.slow
def test_imagenet_config_one_step_under_mock_data(tmp_path):
  config = configs.load("imagenet_resnet50")
  # The protocol's 224x224 crops through the real tfds pipeline on a CPU, with a small batch
  # and budget, and the small CNN in place of ResNet-50 (whose compile takes minutes here;
  # tests/test_models.py checks ResNet-50 itself).
  config.update(batch_size=4, baseline_n=2, n_max=8, num_steps=1, eval_every=0,
                checkpoint_every=1, model="small_cnn")
  config.dataset_kwargs.data_dir = str(tmp_path / "data")
  with tfds.testing.mock_data(num_examples=16):
    rows = train.run(config, str(tmp_path / "run"))
  assert len(rows) == 1 and np.isfinite(rows[0]["cos/sera_expected"])
  assert jax.device_count() >= 1


class _PoisonedUpdateTask:
  """A task whose update at `poison_step` makes the parameters NaN while its metrics, computed
  from the state before the update (as both real tasks do), stay finite."""

  def __init__(self, poison_step):
    self.poison_step = poison_step

  def init_state(self, rng):
    return {"params": {"w": jnp.ones(3)}, "opt_state": jnp.zeros(3), "rng": rng}

  def train_step(self, state, step):
    update = jnp.nan if step == self.poison_step else 1.0
    new = dict(state, params={"w": state["params"]["w"] + update})
    return new, {"loss": jnp.sum(state["params"]["w"])}

  def evaluate(self, state):
    return {}

  def write_figures(self, workdir, rows):
    pass


def test_a_non_finite_update_is_never_saved_as_the_last_good_checkpoint(tmp_path):
  config = ml_collections.ConfigDict(dict(task="toy", method="toy", seed=0, num_steps=6,
                                          eval_every=0, checkpoint_every=1,
                                          checkpoints_to_keep=10))
  task = _PoisonedUpdateTask(poison_step=2)
  with pytest.raises(train.NonFiniteError,
                     match=r"state\['params'\]\['w'\] at step 2.*last good checkpoint \(step 2\)"):
    train.run(config, str(tmp_path), task=task)
  with ocp.CheckpointManager(tmp_path / "checkpoints") as manager:
    assert manager.latest_step() == 2
    restored = manager.restore(2, args=ocp.args.StandardRestore(task.init_state(
        jax.random.PRNGKey(0))))
  assert not train.non_finite_leaves(restored)
  assert [row["step"] for row in train.read_metrics(str(tmp_path))] == [0, 1]


def test_a_run_that_goes_non_finite_before_its_first_checkpoint_says_it_saved_none(tmp_path):
  config = ml_collections.ConfigDict(dict(task="toy", method="toy", seed=0, num_steps=6,
                                          eval_every=0, checkpoint_every=4))
  with pytest.raises(train.NonFiniteError, match=r"at step 2; the run stops here and it saved "
                                                 r"no checkpoint\.$"):
    train.run(config, str(tmp_path), task=_PoisonedUpdateTask(poison_step=2))
  assert not list((tmp_path / "checkpoints").iterdir())


def test_a_corrupted_checkpoint_stops_the_resumed_run_with_one_line_and_changes_nothing(tmp_path):
  config = ml_collections.ConfigDict(dict(task="toy", method="toy", seed=0, num_steps=4,
                                          eval_every=0, checkpoint_every=2))
  task = _PoisonedUpdateTask(poison_step=-1)
  train.run(config, str(tmp_path), task=task)
  corrupt_checkpoint(tmp_path, 4)
  before = listing(tmp_path)
  with pytest.raises(train.CheckpointError) as raised:
    train.run(config, str(tmp_path), task=task)
  message = str(raised.value)
  assert "\n" not in message
  assert f"checkpoint of step 4 in {tmp_path}/checkpoints/4 cannot be restored" in message
  assert "resume from step 2" in message and "new --workdir" in message
  assert listing(tmp_path) == before


@pytest.mark.slow
def test_a_corrupted_checkpoint_stops_the_command_and_its_advice_resumes(tmp_path):
  workdir = tmp_path / "run"
  assert _cli("train", f"--workdir={workdir}", *TINY).returncode == 0
  corrupt_checkpoint(workdir, 6)
  before = listing(workdir)
  resumed = _cli("train", f"--workdir={workdir}", *TINY)
  assert resumed.returncode == 1 and not resumed.stdout
  # The message once, whole (one write), and no traceback through the project's code.
  # TensorStore's own reader threads may still print tracebacks of "Event loop is closed" when
  # Orbax closes its loop under them; that noise is theirs, printed at thread-dependent times (a
  # partial line of it can even precede the message on its line), and is not asserted on.
  message = (
      f"error: the checkpoint of step 6 in {workdir}/checkpoints/6 cannot be restored: it is "
      f"corrupt or incomplete. Nothing in {workdir} was changed; to go on, move "
      f"{workdir}/checkpoints/6 out of {workdir}/checkpoints to resume from step 4, the latest "
      f"earlier checkpoint kept, or start over with a new --workdir.\n")
  assert resumed.stderr.count(message) == 1, resumed.stderr
  assert "sera_jax/harness/" not in resumed.stderr, resumed.stderr
  assert listing(workdir) == before
  (workdir / "checkpoints" / "6").rename(tmp_path / "corrupt-6")
  assert _cli("train", f"--workdir={workdir}", *TINY).returncode == 0
  assert [row["step"] for row in train.read_metrics(str(workdir))] == list(range(6))


class _Ended(Exception):
  """os._exit, made catchable: the process would end with this status."""


@pytest.mark.parametrize("command,module", [(["sweep"], sweep),
                                            (["figure", "maze"], figure_maze)])
def test_sweeps_and_figures_end_with_the_one_line_of_a_checkpoint_they_cannot_restore(
    command, module, monkeypatch, capsys):
  def fail(*args, **kwargs):
    raise train.CheckpointError("the checkpoint of step 6 in d/checkpoints/6 cannot be restored")

  def end(status):
    raise _Ended(status)

  monkeypatch.setattr(module, "main", fail)
  monkeypatch.setattr(os, "_exit", end)
  with pytest.raises(_Ended) as ended:
    cli.main(command)
  assert ended.value.args == (1,)
  # Counted, not equal: a test before this one in the process may have left Orbax reads whose
  # noise lands at any time (as above).
  out, err = capsys.readouterr()
  assert not out and err.count(
      "error: the checkpoint of step 6 in d/checkpoints/6 cannot be restored\n") == 1, err


def _toy_config(num_steps):
  """The loop over `_PoisonedUpdateTask`: a checkpoint every 2 steps, all of them kept."""
  return ml_collections.ConfigDict(dict(task="toy", method="toy", seed=0, num_steps=num_steps,
                                        eval_every=0, checkpoint_every=2,
                                        checkpoints_to_keep=10))


def _toy_rows(num_steps):
  """The rows of an uninterrupted toy run: w = 1 + step in each of 3 entries, loss = sum(w)."""
  return [{"step": step, "loss": 3.0 + 3 * step} for step in range(num_steps)]


def _run_to_six_with_step_four_latest(workdir):
  """A toy run of 6 steps whose latest checkpoint is step 4: rows 4 and 5 lie past it."""
  task = _PoisonedUpdateTask(poison_step=-1)
  assert train.run(_toy_config(6), workdir, task=task) == _toy_rows(6)
  (files.path(workdir) / train.CHECKPOINT_DIR / "6").rmtree()
  return task


_KILLED = 86  # the exit status of a writer the hook below ended
# Trains the toy task in WORKDIR to NUM_STEPS under the bucket double (it passes local paths
# through unchanged) and ends the process, as SIGKILL would (no cleanup, buffered writes lost),
# the moment it has opened a metrics file of WORKDIR for writing.
_KILL_AS_METRICS_OPEN = """
import os, sys
from unittest import mock
import gcs_double
from corrupt_checkpoints import corrupt_checkpoint, listing
from etils.epath import gpath
from test_train import _PoisonedUpdateTask, _toy_config
from sera_jax.harness import train

root, workdir, num_steps, killed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with gcs_double.serve(root):
  backend = gpath._PREFIX_TO_BACKEND[None]  # the double's, which serves every scheme
  opened = backend.open

  def open_then_die(path, mode):
    handle = opened(path, mode)
    if "w" in mode and os.fspath(path).startswith(workdir + "/metrics"):
      os._exit(killed)
    return handle

  with mock.patch.object(backend, "open", open_then_die):
    train.run(_toy_config(num_steps), workdir, task=_PoisonedUpdateTask(poison_step=-1))
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "bucket"])
def test_no_row_is_lost_when_a_resumed_run_is_killed_as_it_opens_its_metrics(tmp_path, where):
  """The resumed leg is killed (in a subprocess) the moment it has opened a metrics file for
  writing, before anything is flushed: every row stored before is still read back, and the
  next resume ends with the rows of an uninterrupted run."""
  root = str(tmp_path / "storage")
  workdir = "gs://bucket/run" if where == "bucket" else str(tmp_path / "run")
  with gcs_double.serve(root):
    task = _run_to_six_with_step_four_latest(workdir)
  killed = subprocess.run(
      [sys.executable, "-c", _KILL_AS_METRICS_OPEN, root, workdir, "8", str(_KILLED)],
      cwd=os.path.dirname(__file__), capture_output=True, text=True, timeout=600)
  assert killed.returncode == _KILLED, f"not killed at the open:\n{killed.stderr[-2000:]}"
  with gcs_double.serve(root):
    assert train.read_metrics(workdir) == _toy_rows(6)
    assert train.run(_toy_config(8), workdir, task=task) == _toy_rows(8)
    assert train.read_metrics(workdir) == _toy_rows(8)


class _Uploads:
  """A writable object of the bucket double that records what a real store would upload: the
  whole object at each flush or close that follows new data (as TensorFlow's GCS files do)."""

  def __init__(self, file, uploaded: list[int]):
    self._file, self._uploaded, self._written, self._stored = file, uploaded, 0, 0

  def write(self, data):
    self._written += len(data)
    return self._file.write(data)

  def writelines(self, lines):
    for line in lines:
      self.write(line)

  def flush(self):
    self._file.flush()
    if self._written > self._stored:
      self._uploaded.append(self._written)
      self._stored = self._written

  def close(self):
    self.flush()
    self._file.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()

  def __getattr__(self, name):
    return getattr(self._file, name)


def test_a_bucket_run_uploads_each_metrics_row_once(tmp_path, monkeypatch):
  workdir = "gs://bucket/run"
  uploads = collections.defaultdict(list)  # object -> the sizes of its uploads
  monkeypatch.setattr(train, "FLUSH_SECONDS", -1.0)  # a flush after every row, too
  with gcs_double.serve(str(tmp_path / "storage")):
    backend = gpath._PREFIX_TO_BACKEND["gs"]
    opened = backend.open

    def recording_open(path, mode):
      handle = opened(path, mode)
      if "w" in mode and os.fspath(path).startswith(f"{workdir}/metrics"):
        return _Uploads(handle, uploads[os.fspath(path)])
      return handle

    monkeypatch.setattr(backend, "open", recording_open)
    task = _run_to_six_with_step_four_latest(workdir)
    assert train.run(_toy_config(8), workdir, task=task) == _toy_rows(8)
    assert train.read_metrics(workdir) == _toy_rows(8)
  assert uploads and all(len(sizes) == 1 for sizes in uploads.values()), dict(uploads)
  # Rows 4 and 5 are written twice: by the first leg, then redone by the resumed one.
  rows = _toy_rows(6) + _toy_rows(8)[4:]
  assert sum(sum(sizes) for sizes in uploads.values()) == sum(
      len(json.dumps(row)) + 1 for row in rows)


def test_a_row_cut_short_by_a_kill_is_no_row_and_is_redone(tmp_path):
  task = _run_to_six_with_step_four_latest(str(tmp_path))
  (part,) = (tmp_path / train.METRICS_DIR).iterdir()
  part.write_text(part.read_text()[:-10])  # a kill in the middle of the last row's write
  assert train.read_metrics(str(tmp_path)) == _toy_rows(5)
  assert train.run(_toy_config(6), str(tmp_path), task=task) == _toy_rows(6)
  assert train.read_metrics(str(tmp_path)) == _toy_rows(6)


def test_a_run_of_an_earlier_version_resumes_without_rewriting_its_metrics_jsonl(tmp_path):
  task = _run_to_six_with_step_four_latest(str(tmp_path))
  legacy = tmp_path / train.LEGACY_METRICS_FILE
  legacy.write_text("".join(json.dumps(row) + "\n" for row in _toy_rows(6)))
  shutil.rmtree(tmp_path / train.METRICS_DIR)
  assert train.run(_toy_config(8), str(tmp_path), task=task) == _toy_rows(8)
  assert train.read_metrics(str(tmp_path)) == _toy_rows(8)
  assert legacy.read_text() == "".join(json.dumps(row) + "\n" for row in _toy_rows(6))


def test_tensorboard_events_read_back_with_the_logged_scalars(tmp_path):
  config = ml_collections.ConfigDict(dict(task="toy", method="toy", seed=0, num_steps=4,
                                          eval_every=0, checkpoint_every=4))
  rows = train.run(config, str(tmp_path), task=_PoisonedUpdateTask(poison_step=-1))
  tf = tensorflow()
  logged = {}
  for path in tf.io.gfile.glob(str(tmp_path / train.TENSORBOARD_DIR / "events.out.tfevents*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        logged[value.tag, event.step] = float(tf.make_ndarray(value.tensor))
  assert logged == {("loss", row["step"]): pytest.approx(row["loss"]) for row in rows}


def test_tensorboard_shows_the_steps_a_resumed_leg_redoes_once(tmp_path):
  """A leg killed after step 14 whose run resumes from its checkpoint of step 10: TensorBoard
  (its own event accumulator) shows steps 10-14 once, the resumed leg's, as `read_metrics`
  reads them; before each leg started with a session start it showed them twice."""
  from tensorboard.backend.event_processing import plugin_event_accumulator
  from tensorboard.util import tensor_util
  killed = train.MetricLog(tmp_path)
  for step in range(15):
    killed.write({"step": step, "loss": float(step)})
  killed.flush()  # stored, never closed: the process died
  resumed = train.MetricLog(tmp_path, start_step=10)
  for step in range(10, 20):
    resumed.write({"step": step, "loss": 100.0 + step})
  resumed.close()
  events = plugin_event_accumulator.EventAccumulator(str(tmp_path / train.TENSORBOARD_DIR),
                                                     size_guidance={"tensors": 0})
  events.Reload()
  shown = [(event.step, tensor_util.make_ndarray(event.tensor_proto).item())
           for event in events.Tensors("loss")]
  assert shown == [(row["step"], row["loss"]) for row in train.read_metrics(tmp_path)]
  assert shown == [(step, float(step)) for step in range(10)] + [
      (step, 100.0 + step) for step in range(10, 20)]


@pytest.mark.slow
def test_profile_steps_write_a_trace_into_the_workdir(tmp_path):
  config = base_config()
  config.update(num_steps=5, eval_every=0, checkpoint_every=5, profile_steps="1:4")
  train.run(config, str(tmp_path))
  traces = list((tmp_path / train.PROFILE_DIR).rglob("*.xplane.pb"))
  assert len(traces) == 1 and traces[0].stat().st_size > 0
  config.profile_steps = "4:9"
  with pytest.raises(ValueError, match="profile_steps must be 'A:B'"):
    train.validate_run_config(config)
