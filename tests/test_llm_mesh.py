"""SeraLearner on device meshes: 8 fake CPU devices train the tiny and arithmetic tasks like one.

Each task trains a few steps on one device, colocated on (fsdp, tp) = (2, 4) and (4, 2)
meshes, and disaggregated (actor and reference on 4 devices, the rollout on the other 4).
Every step's counts must equal the one-device run's, the losses and final parameters agree
to float32 tolerance, and every train example reaches the actor's step sharded along fsdp.
The tiny task's first epoch is uniform and SERA allocates from its third step on; the
arithmetic task allocates from the first step with the exact log p of a warm-started decoder.
Fake devices need their own interpreter: this file is also the script it runs (`_main`).
"""

import contextlib
import io
import itertools
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.sft import peft_trainer

from sera_jax.settings.llm import arithmetic, tiny
from sera_jax.settings.llm import cluster as cluster_lib
from sera_jax.settings.llm import learner as sera_llm

DEVICES = 8
# (actor mesh, rollout mesh or None: the actor's); a disaggregated rollout takes the devices
# after the actor's.
LAYOUTS = {"one": ((1, 1), None), "fsdp2_tp4": ((2, 4), None), "fsdp4_tp2": ((4, 2), None),
           "disaggregated": ((2, 2), (2, 2))}
HEADS = tiny.heads_for(4)  # one decoder for every layout: its heads split over tp = 4
# (steps, prompts a step): the tiny task's epoch of 16 prompts is 2 steps, uniform in the
# first; the arithmetic task's oracle allocates from the first step.
STEPS = {"tiny": (3, 8), "arithmetic": (3, 4)}
N0, N_MAX, PROMPTS = 4, 16, 16
# float32 sums in another order: seen up to 3e-5 relative in the parameters after 3 steps.
RTOL, ATOL = 1e-4, 1e-6
# A key bias adds the same q.b to every attention logit of a query, which the softmax
# removes: its exact gradient is 0 and the computed one is rounding noise that depends on
# the reduction order, which Adam scales to steps of up to its learning rate (1e-2). They
# drift apart between layouts (seen up to 5e-5) without changing the policy.
KEY_BIAS_ATOL = 2e-4
TIMEOUT_S = 1200


def _meshes(layout: str):
  actor_shape, rollout_shape = LAYOUTS[layout]
  devices = jax.devices()
  actor_size = int(np.prod(actor_shape))
  actor = cluster_lib.make_mesh(actor_shape, devices[:actor_size])
  if rollout_shape is None:
    return actor, None
  return actor, cluster_lib.make_mesh(rollout_shape,
                                      devices[actor_size:actor_size + np.prod(rollout_shape)])


def _arithmetic_problems() -> arithmetic.Problems:
  return arithmetic.split({"train": PROMPTS}, digits=1, seed=0)["train"]


def _warm_arithmetic_state():
  """A decoder briefly taught the one-digit sums it then trains on, so their exact p spread."""
  model = tiny.decoder(0, **HEADS)
  arithmetic.warm_start(model, _arithmetic_problems(), steps=40, batch_size=16,
                        learning_rate=1e-2, seed=0)
  return jax.device_get(nnx.state(model))


def _learner(task: str, layout: str, warm_state):
  """SeraLearner of `task` on `layout`'s meshes and its training batches."""
  num_steps, batch_size = STEPS[task]
  actor_mesh, rollout_mesh = _meshes(layout)
  config = dict(num_generations=N0, n_max=N_MAX, dataset_size=PROMPTS)
  if task == "tiny":
    cluster = tiny.cluster(num_steps, actor_mesh=actor_mesh, rollout_mesh=rollout_mesh, **HEADS)
    learner = sera_llm.SeraLearner(cluster, sera_llm.SeraConfig(**config), tiny.slack_reward)
    return learner, tiny.dataset(num_steps, batch_size)
  model = tiny.decoder(0, **HEADS)
  nnx.update(model, jax.tree.map(jax.numpy.asarray, warm_state))
  cluster = cluster_lib.build(model, arithmetic.TOKENIZER, actor_mesh, rollout_mesh=rollout_mesh,
                              optimizer=optax.adam(1e-2), max_steps=num_steps,
                              rollout_config=arithmetic.rollout_config(1))
  learner = sera_llm.SeraLearner(
      cluster, sera_llm.SeraConfig(**config, log_p_source=arithmetic.batch_log_p),
      arithmetic.exact_reward)
  return learner, list(itertools.islice(
      sera_llm.epoch_batches(_arithmetic_problems().columns(), batch_size, 0), num_steps))


def _placed_as_annotated(model, mesh) -> bool:
  """Whether every parameter of `model` lies on `mesh` as its sharding annotation says."""
  params = nnx.state(model, nnx.Param)
  return all(leaf.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), leaf.ndim)
             for leaf, spec in zip(jax.tree.leaves(params),
                                   jax.tree.leaves(nnx.get_partition_spec(params)), strict=True))


def _train(task: str, layout: str, warm_state) -> dict[str, np.ndarray]:
  """One run: every step's counts and loss, the final parameters, the placements seen."""
  learner, batches = _learner(task, layout, warm_state)
  counts, placements = [], []
  process = learner._process_accumulated_batches
  shard_input = peft_trainer.sharding_utils.shard_input

  def recording_process(micro_batches, micro_batch_sizes, mode):
    produced = process(micro_batches, micro_batch_sizes, mode)
    if produced:
      counts.append(learner.last_counts)
    return produced

  def recording_shard_input(example, axes):
    sharded = shard_input(example, axes)
    placements.extend((list(leaf.sharding.spec), leaf.sharding.is_fully_replicated)
                      for leaf in jax.tree.leaves(sharded))
    return sharded

  learner._process_accumulated_batches = recording_process
  peft_trainer.sharding_utils.shard_input = recording_shard_input
  cluster = learner.rl_cluster
  try:
    with jax.set_mesh(cluster.r2m[rl_cluster_lib.Role.ACTOR]):
      learner.train(batches)
  finally:
    peft_trainer.sharding_utils.shard_input = shard_input
  params = nnx.state(cluster.actor_trainer.model, nnx.Param)
  rollout_devices = {device.id for leaf in jax.tree.leaves(nnx.state(cluster.rollout.model()))
                     for device in leaf.sharding.device_set}
  as_annotated = [_placed_as_annotated(cluster.actor_trainer.model,
                                       cluster.r2m[rl_cluster_lib.Role.ACTOR]),
                  _placed_as_annotated(cluster.rollout.model(),
                                       cluster.r2m[rl_cluster_lib.Role.ROLLOUT])]
  loss = cluster.actor_trainer.metrics_logger.get_metric_history("actor", "loss", "train")
  return {"counts": np.stack(counts), "loss": np.asarray(loss),
          "placements": np.array(json.dumps(placements)),
          "rollout_devices": np.array(sorted(rollout_devices)),
          "as_annotated": np.array(as_annotated),
          "sharded_params": np.array(sum(not leaf.sharding.is_fully_replicated
                                         for leaf in jax.tree.leaves(params))),
          **{f"param{jax.tree_util.keystr(path)}": np.asarray(leaf)
             for path, leaf in jax.tree_util.tree_leaves_with_path(params)}}


def _refuse_undivided_micro_batches() -> str:
  """The message of a learner whose train micro-batches (4 rows) an fsdp axis of 8 cannot split."""
  cluster = tiny.cluster(1, actor_mesh=cluster_lib.make_mesh((8, 1)), train_micro_batch_size=1)
  learner = sera_llm.SeraLearner(
      cluster, sera_llm.SeraConfig(num_generations=N0, n_max=N_MAX, dataset_size=PROMPTS),
      tiny.slack_reward)
  try:
    learner.train(tiny.dataset(1, tiny.BATCH_SIZE))
  except ValueError as error:
    return str(error)
  return "not refused"


def _command_on_a_mesh() -> str:
  """What `python -m sera_jax.settings.llm.tiny --mesh 2,4 --steps 1` prints."""
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    tiny.main(["--mesh", "2,4", "--steps", "1"])
  return printed.getvalue()


def _main(out_path: str) -> None:
  """`python tests/test_llm_mesh.py OUT.npz`: every task on every layout, into OUT.npz."""
  assert jax.device_count() == DEVICES, jax.devices()
  warm_state = _warm_arithmetic_state()
  results = {"refusal": np.array(_refuse_undivided_micro_batches()),
             "command": np.array(_command_on_a_mesh())}
  for task, layout in itertools.product(STEPS, LAYOUTS):
    start = time.perf_counter()
    run = _train(task, layout, warm_state)
    results |= {f"{task}/{layout}/{name}": value for name, value in run.items()}
    print(f"{task} {layout}: {time.perf_counter() - start:.1f} s", flush=True)
  np.savez(out_path, **results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  out = tmp_path_factory.mktemp("mesh") / "runs.npz"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      f" --xla_force_host_platform_device_count={DEVICES}").strip()
  start = time.perf_counter()
  child = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True,
                         text=True, timeout=TIMEOUT_S)
  assert child.returncode == 0, child.stderr[-4000:]
  print(child.stdout, f"all runs: {time.perf_counter() - start:.0f} s")
  with np.load(out) as loaded:
    return dict(loaded)


@pytest.mark.slow
@pytest.mark.parametrize("task", sorted(STEPS))
@pytest.mark.parametrize("layout", sorted(set(LAYOUTS) - {"one"}))
def test_a_mesh_trains_like_one_device(runs, task, layout):
  """Same counts at every step, losses and parameters within float32 tolerance, parameters
  placed by their Qwen2 sharding annotations (which MaskedQwen2 keeps), train examples sharded
  along fsdp (not replicated), and a disaggregated rollout on its own devices."""
  got, want = (
      {name.split("/", 2)[2]: value for name, value in runs.items()
       if name.startswith(f"{task}/{run}/")} for run in (layout, "one"))
  num_steps, batch_size = STEPS[task]
  assert got["counts"].shape == (num_steps, batch_size)
  np.testing.assert_array_equal(got["counts"], want["counts"])
  assert (got["counts"].sum(axis=1) == batch_size * N0).all()
  assert (got["counts"].max(axis=1) > N0).any()  # SERA allocated unevenly
  np.testing.assert_allclose(got["loss"], want["loss"], rtol=RTOL, atol=ATOL)
  params = sorted(name for name in got if name.startswith("param"))
  assert params == sorted(name for name in want if name.startswith("param"))
  for name in params:
    np.testing.assert_allclose(got[name], want[name], rtol=RTOL,
                               atol=KEY_BIAS_ATOL if "['k_bias']" in name else ATOL,
                               err_msg=name)
  assert got["as_annotated"].all() and got["sharded_params"] > 0
  placements = json.loads(str(got["placements"]))
  assert placements and all(spec == ["fsdp"] and not replicated
                            for spec, replicated in placements), placements
  actor_size = int(np.prod(LAYOUTS[layout][0]))
  rollout = set(range(actor_size, DEVICES) if layout == "disaggregated" else range(actor_size))
  assert set(got["rollout_devices"].tolist()) == rollout


@pytest.mark.slow
def test_train_micro_batches_the_fsdp_axis_cannot_split_are_refused(runs):
  assert str(runs["refusal"]).startswith("a train micro-batch holds B / 4 = 4 rollouts, which "
                                         "the actor mesh's ('fsdp',) axes (8 devices) do not "
                                         "divide"), runs["refusal"]


@pytest.mark.slow
def test_the_tiny_command_trains_on_a_mesh(runs):
  assert str(runs["command"]).startswith("1 batches allocated; the last one's counts: [4, 4, 4, 4]")


if __name__ == "__main__":
  _main(sys.argv[1])
