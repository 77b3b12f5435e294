"""Scale-out: 8 fake CPU devices, and two processes joined by jax.distributed, train like one.

For each task (classification on the digits, maze navigation) the reference is a short SERA
run on this process's single CPU device. Every run records the SERA counts of every prompt
at every step (a metric per prompt, added by wrapping the step's rollout statistics), so
"the same allocations" is checked count by count, not through summaries; parameters are
compared from the final Orbax checkpoints. The sharded runs: one process with 8 fake
devices, and two processes of 2 fake devices each joined by `jax.distributed.initialize`
(gloo CPU collectives), stopped after a checkpoint and resumed with `--resume`. Their
workdirs are gs:// URLs served by the filesystem double of tests/gcs_double.py, through the
code a real bucket takes. Fake devices and the extra processes need their own interpreters:
this file is also the script they run (see `_main`).
"""

import collections
import dataclasses
import functools
import os
import socket
import subprocess
import sys

import gcs_double
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from sera_jax.common import files, sharding
from sera_jax.harness import cli, configs, train
from sera_jax.method import allocation
from sera_jax.settings.classification import task as classification_task
from sera_jax.settings.maze import task as maze_task

DOUBLE_ROOT = "SERA_JAX_TEST_GCS_ROOT"  # the subprocesses serve gs:// from this directory
TIMEOUT_S = 600  # a hang guard, as the other tests' subprocesses: the runs take about a minute


@dataclasses.dataclass(frozen=True)
class Case:
  """A task's short run: its train flags, length, checkpoint step and tolerances."""
  flags: tuple[str, ...]
  num_steps: int
  stop_at: int
  baseline_n: int
  rtol: float
  figure: str


CASES = {
    "classification": Case(("--config.num_steps=20", "--config.eval_every=10",
                            "--config.checkpoint_every=10"), 20, 10, 8, 1e-5, "alignment.png"),
    # Epochs of 2 RL steps after a 2-step warm start: SERA allocates from step 4 on.
    "maze": Case(("--config=maze", "--config.maze_size=7", "--config.num_steps=10",
                  "--config.num_validation_mazes=0", "--config.num_sft_mazes=64",
                  "--config.sft_batch_size=8", "--config.sft_learning_rate=1e-2",
                  "--config.sft_disjoint_paths=false",
                  "--config.eval_samples=64",
                  "--config.num_train_mazes=16", "--config.batch_size=8",
                  "--config.baseline_n=4", "--config.n_max=16", "--config.num_eval_mazes=8",
                  "--config.eval_batch_size=8", "--config.dim=16", "--config.num_layers=1",
                  "--config.num_heads=2", "--config.eval_every=10",
                  "--config.checkpoint_every=6"), 10, 6, 4, 1e-4, "maze.png"),
}
# The surrogate loss is a signed sum that cancels to ~1e-3 on some steps; compare it (and
# every metric) to a tolerance of its typical size as well as of its value.
ATOL = 1e-7


class _Preempted(Exception):
  """Stops a run at a given step, after its checkpoints, as a preemption would."""


def _task_name(flags) -> str:
  return "maze" if "--config=maze" in flags else "classification"


def _record_counts(rollout_metrics):
  """Wraps a task's rollout statistics to report n_q of every prompt as metric counts/q."""

  @functools.wraps(rollout_metrics)
  def wrapped(alloc, *args, **kwargs):
    counts = {f"counts/{q}": alloc.counts[q] for q in range(alloc.counts.shape[0])}
    return rollout_metrics(alloc, *args, **kwargs) | counts

  return wrapped


def _recording(name: str):
  """(module, attribute) whose rollout statistics `_record_counts` wraps for task `name`."""
  if name == "maze":
    return maze_task.allocation, "rollout_metrics"
  return classification_task, "_rollout_metrics"


def _check_allocation(mesh) -> None:
  """jit(allocate) of a log p sharded on "data" gives the single-device counts and weights."""
  log_p = np.log(np.random.default_rng(0).beta(0.3, 1.5, 256).clip(1e-30)).astype(np.float32)
  fn = jax.jit(functools.partial(allocation.allocate, baseline_n=8, n_min=2, n_max=32))
  local = jax.device_get(fn(jax.device_put(log_p, jax.local_devices()[0])))
  sharded = fn(jax.device_put(log_p, sharding.data_sharding(mesh)))
  assert 0 < local.active.sum() < 256 and local.counts.max() > 8  # sera's every branch
  for got, want in ((sharded.counts, local.counts), (sharded.weights, local.weights)):
    np.testing.assert_array_equal(jax.device_get(got), want)


def _check_classification_placement(task, state) -> None:
  """Allocation of a sharded log p equals the single-device one; hosts own their data rows.

  The allocation check runs in one process only: compiling the allocator twice more
  would cost the two-process legs more time than it adds there.
  """
  del state
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


def _check_maze_placement(task, state) -> None:
  """The state sits whole on every device of the mesh, and an RL step sums over devices."""
  devices = set(task.mesh.devices.flat)
  assert len(devices) == jax.device_count()
  for leaf in jax.tree.leaves(state):
    assert leaf.sharding.device_set == devices and leaf.sharding.is_fully_replicated
  ids = sharding.replicate(np.arange(task.config.batch_size, dtype=np.int32), task.mesh)
  compiled = task._rl_step.lower(state, ids, 0, False).compile()
  assert "all-reduce" in compiled.as_text()  # the rollouts' gradients live on every device


PLACEMENT_CHECKS = {"classification": _check_classification_placement,
                    "maze": _check_maze_placement}
TASK_CLASSES = {"classification": classification_task.ClassificationTask,
                "maze": maze_task.MazeTask}


def _main(argv: list[str]) -> None:
  """`python tests/test_sharding.py [--check_placement] [--stop_at=N] TRAIN_FLAGS...`.

  Runs `sera-jax train TRAIN_FLAGS` recording the counts, with gs:// served from
  $SERA_JAX_TEST_GCS_ROOT; `--check_placement` first checks the placement of data and
  state on the task's mesh, `--stop_at=N` stops before step N.
  """
  stop_at = next((int(a.split("=")[1]) for a in argv if a.startswith("--stop_at=")), None)
  check_placement = "--check_placement" in argv
  flags = [a for a in argv if not a.startswith(("--stop_at=", "--check_placement"))]
  name = _task_name(flags)
  module, attribute = _recording(name)
  setattr(module, attribute, _record_counts(getattr(module, attribute)))
  task_class = TASK_CLASSES[name]
  train_step = task_class.train_step
  started = []

  def instrumented_step(self, state, step):
    if check_placement and not started:
      PLACEMENT_CHECKS[name](self, state)
      print(f"placement checked on process {jax.process_index()}")
    started.append(step)
    if step == stop_at:
      raise _Preempted(step)
    return train_step(self, state, step)

  task_class.train_step = instrumented_step
  with gcs_double.serve(os.environ[DOUBLE_ROOT]):
    try:
      cli.main(["train", *flags])
    except _Preempted:
      print(f"stopped at step {stop_at}")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _env(devices_per_process: int, cache_dir: str, storage: str) -> dict[str, str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache_dir,
             **{DOUBLE_ROOT: storage},
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


def _multihost(flags: list[str], env: dict[str, str]) -> list[str]:
  common = [*flags, "--multihost", f"--coordinator=localhost:{_free_port()}",
            "--num_processes=2"]
  return _finish([_launch([*common, f"--process_id={i}"], env) for i in range(2)])


@pytest.fixture(scope="module", params=sorted(CASES))
def runs(request, tmp_path_factory):
  """The task, the double's root and the reference, 8-device and two-process workdirs.

  The reference trains locally in this process; the sharded runs train into gs:// URLs.
  """
  name, case = request.param, CASES[request.param]
  root = tmp_path_factory.mktemp(f"scale_{name}")
  storage, cache = str(root / "storage"), str(root / "compilation_cache")
  workdirs = {"one": str(root / "one")} | {
      run: f"gs://bucket/{name}/{run}" for run in ("eight", "two_hosts")}
  flags = [*case.flags]
  # The subprocesses start first and train while this process runs the reference.
  eight = _launch(["--check_placement", *flags, f"--workdir={workdirs['eight']}"],
                  _env(8, cache, storage))
  module, attribute = _recording(name)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(module, attribute, _record_counts(getattr(module, attribute)))
    cli.main(["train", *flags, f"--workdir={workdirs['one']}"])
  assert "placement checked on process 0" in _finish([eight])[0]
  env = _env(2, cache, storage)
  two_hosts = [*flags, f"--workdir={workdirs['two_hosts']}"]
  first_leg = _multihost([*two_hosts, "--check_placement", f"--stop_at={case.stop_at}"], env)
  second_leg = _multihost([*two_hosts, "--resume"], env)
  return name, storage, workdirs, first_leg, second_leg


def _assert_same_run(case: Case, workdir: str, reference: str) -> None:
  rows, expected = train.read_metrics(workdir), train.read_metrics(reference)
  assert [r["step"] for r in rows] == list(range(case.num_steps))
  batch_size = next(int(f.split("=")[1]) for f in (*case.flags, "--config.batch_size=64")
                    if f.startswith("--config.batch_size="))
  assert max(sum(name.startswith("counts/") for name in row) for row in rows) == batch_size
  for row, want in zip(rows, expected, strict=True):
    assert row.keys() == want.keys()
    counts = sorted(name for name in row if name.startswith("counts/"))
    assert [row[n] for n in counts] == [want[n] for n in counts], f"step {row['step']}"
    names = sorted(set(row) - set(counts))
    np.testing.assert_allclose([row[n] for n in names], [want[n] for n in names],
                               rtol=case.rtol, atol=ATOL, err_msg=f"step {row['step']}: {names}")
  assert any(r.get("rollouts/max", 0) > case.baseline_n for r in rows)  # SERA spends unevenly


def _final_state(case: Case, workdir: str, like):
  with ocp.CheckpointManager(files.path(workdir) / train.CHECKPOINT_DIR) as manager:
    assert manager.latest_step() == case.num_steps
    return manager.restore(case.num_steps, args=ocp.args.StandardRestore(like))


def _without_key_biases(params, dim: int):
  """The maze policy's parameters with the attention key biases zeroed.

  A key bias adds the same q.b to every attention logit of a query, which the softmax
  removes: its exact gradient is 0, the computed one is rounding noise that depends on
  the reduction order, and Adam scales any nonzero noise to a step of about the learning
  rate. Those entries drift apart between device layouts without changing the policy.
  """
  def zeroed(path, leaf):
    if jax.tree_util.keystr(path).endswith("['qkv']['bias']"):
      return leaf.at[dim:2 * dim].set(0)
    return leaf
  return jax.tree_util.tree_map_with_path(zeroed, params)


def _assert_same_parameters(name: str, workdir: str, reference: str) -> None:
  case = CASES[name]
  config = configs.train_flags(["sera-jax train", *case.flags]).config
  like = TASK_CLASSES[name](config).init_state(jax.random.PRNGKey(0))
  state, want = _final_state(case, workdir, like), _final_state(case, reference, like)
  if name == "maze":
    state, want = (s._replace(params=_without_key_biases(s.params, config.dim))
                   for s in (state, want))
  for got, expected in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=case.rtol, atol=ATOL)
  moved = jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), want.params, like.params)
  assert max(jax.tree.leaves(moved)) > 1e-3  # the runs trained


@pytest.mark.slow
def test_eight_devices_train_like_one(runs):
  name, storage, workdirs, _, _ = runs
  with gcs_double.serve(storage):
    _assert_same_run(CASES[name], workdirs["eight"], workdirs["one"])
    _assert_same_parameters(name, workdirs["eight"], workdirs["one"])


@pytest.mark.slow
def test_two_processes_train_stop_and_resume_like_one(runs):
  name, storage, workdirs, first_leg, second_leg = runs
  case, workdir = CASES[name], workdirs["two_hosts"]
  for output in first_leg:
    assert "placement checked" in output and f"stopped at step {case.stop_at}" in output
  with gcs_double.serve(storage):
    _assert_same_run(case, workdir, workdirs["one"])
    _assert_same_parameters(name, workdir, workdirs["one"])
    # Process 0 alone writes: one metrics file with each step once, one event file per leg,
    # the figure; process 1 prints no metrics and no progress bar.
    directory = files.path(workdir)
    assert len(list((directory / "tensorboard").iterdir())) == 2
    assert (directory / case.figure).stat().length > 10_000
    assert sorted(int(p.name) for p in (directory / "checkpoints").iterdir()) == [
        case.stop_at, case.num_steps]
  assert f'"step": {case.num_steps - 1}' in second_leg[0] and f"{name}/sera" in second_leg[0]
  for output in (first_leg[1], second_leg[1]):
    assert '"step"' not in output and f"{name}/sera" not in output
  # The bucket's objects are in the double's directory, nothing under a local "gs:".
  assert os.path.isdir(os.path.join(storage, "bucket", name, "two_hosts", "checkpoints"))
  assert not os.path.exists("gs:")


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
