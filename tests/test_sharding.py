"""Scale-out: 8 fake CPU devices, and two processes joined by jax.distributed, train like one.

The reference is a 20-step SERA run of the default digits config on this process's single
CPU device. Every run records the SERA counts of every prompt at every step (a metric per
prompt, added by patching the rollout statistics of the step), so "the same allocations" is
checked count by count, not through summaries; parameters are compared from the step-20
Orbax checkpoints. The sharded runs: one process with 8 fake devices, and two processes of 2
fake devices each joined by `jax.distributed.initialize` (gloo CPU collectives), stopped
after step 10's checkpoint and resumed with `--resume`. Fake devices and the extra processes
need their own interpreters: this file is also the script they run (see `_main`).
"""

import collections
import functools
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from sera_jax.common import sharding
from sera_jax.harness import cli, train
from sera_jax.harness.configs.base import classification as base_config
from sera_jax.method import allocation
from sera_jax.settings.classification import task as classification_task

NUM_STEPS = 20
RUN_FLAGS = ["--config.num_steps=20", "--config.eval_every=10", "--config.checkpoint_every=10"]
RTOL = 1e-5
# The surrogate loss is a signed sum that cancels to ~1e-3 on some steps; compare it (and
# every metric) to RTOL of its typical size as well as of its value.
ATOL = 1e-7
TIMEOUT_S = 240


class _Preempted(Exception):
  """Stops a run at a given step, after its checkpoints, as a preemption would."""


def _record_counts(rollout_metrics):
  """Wraps `_rollout_metrics` to report n_q of every prompt as metric counts/q."""

  @functools.wraps(rollout_metrics)
  def wrapped(alloc, rollouts, log_p):
    counts = {f"counts/{q}": alloc.counts[q] for q in range(alloc.counts.shape[0])}
    return rollout_metrics(alloc, rollouts, log_p) | counts

  return wrapped


def _check_allocation(mesh) -> None:
  """jit(allocate) of a log p sharded on "data" gives the single-device counts and weights."""
  log_p = np.log(np.random.default_rng(0).beta(0.3, 1.5, 256).clip(1e-30)).astype(np.float32)
  fn = jax.jit(functools.partial(allocation.allocate, baseline_n=8, n_min=2, n_max=32))
  local = jax.device_get(fn(jax.device_put(log_p, jax.local_devices()[0])))
  sharded = fn(jax.device_put(log_p, sharding.data_sharding(mesh)))
  assert 0 < local.active.sum() < 256 and local.counts.max() > 8  # sera's every branch
  for got, want in ((sharded.counts, local.counts), (sharded.weights, local.weights)):
    np.testing.assert_array_equal(jax.device_get(got), want)


def _check_placement(task) -> None:
  """Allocation of a sharded log p equals the single-device one; hosts own their data rows.

  The allocation check runs in one process only: compiling the allocator twice more
  would cost the two-process legs more time than it adds there.
  """
  if jax.process_count() == 1:
    _check_allocation(task.mesh)
  images, labels = task._batch(0)
  config = task.config
  whole = task.dataset.train_batch(0, config.batch_size, config.seed)
  rows_per_host = config.batch_size // jax.process_count()
  for name, array in (("image", images), ("label", labels)):
    assert array.shape[0] == config.batch_size
    for shard in array.addressable_shards:
      rows = shard.index[0]
      assert rows.start // rows_per_host == jax.process_index()
      np.testing.assert_array_equal(np.asarray(shard.data), whole[name][rows])
  print(f"placement checked on process {jax.process_index()}")


def _main(argv: list[str]) -> None:
  """`python tests/test_sharding.py [--check_placement] [--stop_at=N] TRAIN_FLAGS...`.

  Runs `sera-jax train TRAIN_FLAGS` recording the counts; `--check_placement` first checks
  allocation and data placement on the task's mesh, `--stop_at=N` stops before step N.
  """
  classification_task._rollout_metrics = _record_counts(classification_task._rollout_metrics)
  stop_at = next((int(a.split("=")[1]) for a in argv if a.startswith("--stop_at=")), None)
  check_placement = "--check_placement" in argv
  flags = [a for a in argv if not a.startswith(("--stop_at=", "--check_placement"))]
  train_step = classification_task.ClassificationTask.train_step
  started = []

  def instrumented_step(self, state, step):
    if check_placement and not started:
      _check_placement(self)
    started.append(step)
    if step == stop_at:
      raise _Preempted(step)
    return train_step(self, state, step)

  classification_task.ClassificationTask.train_step = instrumented_step
  try:
    cli.main(["train", *flags])
  except _Preempted:
    print(f"stopped at step {stop_at}")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _env(devices_per_process: int, cache_dir: str) -> dict[str, str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache_dir,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      f" --xla_force_host_platform_device_count={devices_per_process}").strip()
  return env


def _launch(args: list[str], env: dict[str, str]) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, __file__, *args], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def _finish(processes: list[subprocess.Popen]) -> list[str]:
  outputs = []
  try:
    for process in processes:
      outputs.append(process.communicate(timeout=TIMEOUT_S)[0])
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
  for process, output in zip(processes, outputs, strict=True):
    assert process.returncode == 0, output[-3000:]
  return outputs


def _multihost(workdir: str, extra: list[str], env: dict[str, str]) -> list[str]:
  common = [*RUN_FLAGS, f"--workdir={workdir}", "--multihost",
            f"--coordinator=localhost:{_free_port()}", "--num_processes=2", *extra]
  return _finish([_launch([*common, f"--process_id={i}"], env) for i in range(2)])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Workdirs of the reference, the 8-device and the two-process (stopped, resumed) runs."""
  root = tmp_path_factory.mktemp("scale")
  cache = str(root / "compilation_cache")
  workdirs = {name: str(root / name) for name in ("one", "eight", "two_hosts")}
  # The subprocesses start first and train while this process runs the reference.
  eight = _launch(["--check_placement", *RUN_FLAGS, f"--workdir={workdirs['eight']}"],
                  _env(8, cache))
  patched = _record_counts(classification_task._rollout_metrics)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(classification_task, "_rollout_metrics", patched)
    cli.main(["train", *RUN_FLAGS, f"--workdir={workdirs['one']}"])
  assert "placement checked on process 0" in _finish([eight])[0]
  env = _env(2, cache)
  first_leg = _multihost(workdirs["two_hosts"], ["--check_placement", "--stop_at=10"], env)
  second_leg = _multihost(workdirs["two_hosts"], ["--resume"], env)
  return workdirs, first_leg, second_leg


def _assert_same_run(workdir: str, reference: str) -> None:
  rows, expected = train.read_metrics(workdir), train.read_metrics(reference)
  assert [r["step"] for r in rows] == list(range(NUM_STEPS))
  assert sum(name.startswith("counts/") for name in rows[0]) == base_config().batch_size
  for row, want in zip(rows, expected, strict=True):
    assert row.keys() == want.keys()
    counts = sorted(name for name in row if name.startswith("counts/"))
    assert [row[n] for n in counts] == [want[n] for n in counts], f"step {row['step']}"
    names = sorted(set(row) - set(counts))
    np.testing.assert_allclose([row[n] for n in names], [want[n] for n in names],
                               rtol=RTOL, atol=ATOL, err_msg=f"step {row['step']}: {names}")
  assert any(r["rollouts/max"] > 8 for r in rows)  # SERA spends unevenly


def _final_state(workdir: str, like):
  with ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints"))) as manager:
    assert manager.latest_step() == NUM_STEPS
    return manager.restore(NUM_STEPS, args=ocp.args.StandardRestore(like))


def _assert_same_parameters(workdir: str, reference: str) -> None:
  config = base_config()
  like = classification_task.ClassificationTask(config).init_state(jax.random.PRNGKey(0))
  state, want = _final_state(workdir, like), _final_state(reference, like)
  for got, expected in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=RTOL, atol=ATOL)
  moved = jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), want.params, like.params)
  assert max(jax.tree.leaves(moved)) > 1e-3  # the runs trained


@pytest.mark.slow
def test_eight_devices_train_like_one(runs):
  workdirs, _, _ = runs
  _assert_same_run(workdirs["eight"], workdirs["one"])
  _assert_same_parameters(workdirs["eight"], workdirs["one"])


@pytest.mark.slow
def test_two_processes_train_stop_and_resume_like_one(runs):
  workdirs, first_leg, second_leg = runs
  workdir = workdirs["two_hosts"]
  for output in first_leg:
    assert "placement checked" in output and "stopped at step 10" in output
  _assert_same_run(workdir, workdirs["one"])
  _assert_same_parameters(workdir, workdirs["one"])
  # Process 0 alone writes: one metrics file with each step once, one event file per leg,
  # the figure; process 1 prints no metrics and no progress bar.
  assert len(os.listdir(os.path.join(workdir, "tensorboard"))) == 2
  assert os.path.getsize(os.path.join(workdir, "alignment.png")) > 10_000
  assert '"step": 19' in second_leg[0] and "classification/sera" in second_leg[0]
  for output in (first_leg[1], second_leg[1]):
    assert '"step"' not in output and "classification/sera" not in output
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["10", "20"]


if __name__ == "__main__":
  _main(sys.argv[1:])


def test_the_mesh_helpers_on_this_process():
  """In-process checks of the helpers the sharded runs above are built from."""
  mesh = sharding.make_mesh()
  assert mesh.axis_names == (sharding.DATA_AXIS,) and mesh.size == jax.device_count()
  local = {"label": np.arange(8, dtype=np.int32)}
  batch = sharding.global_batch(local, mesh)
  np.testing.assert_array_equal(batch["label"], local["label"])
  assert batch["label"].sharding == sharding.data_sharding(mesh)
  log_p = jnp.log(jnp.linspace(0.01, 0.99, 8))
  solve = lambda lp: allocation.allocate(lp, baseline_n=4, n_min=2, n_max=16).counts  # noqa: E731
  np.testing.assert_array_equal(jax.jit(sharding.on_every_device(solve, mesh))(log_p),
                                solve(log_p))
  with pytest.raises(ValueError, match="divisible by the device count"):
    sharding.check_batch_divisible("config.batch_size", 6, 4)
  Device = collections.namedtuple("Device", "process_index id")
  with pytest.raises(ValueError, match="same number of devices"):
    sharding.make_mesh([Device(0, 0), Device(0, 1), Device(1, 2)])
