"""SERA inside Tunix (the [llm] extra): registered estimators, peer parity with Tunix's own
GRPO learner, and a tiny decoder trained, stopped and resumed with SERA's allocation."""

import ast
import importlib.metadata
import inspect
import pathlib
import subprocess
import sys
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tunix.models.qwen2 import model as qwen2
from tunix.rl import function_registry
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner

import sera_jax
from sera_jax.settings.llm import cluster as cluster_lib
from sera_jax.settings.llm import learner as sera_llm
from sera_jax.settings.llm import tiny, tunix_compat

N0, M = 4, 4
TRAIN = rl_cluster_lib.Mode.TRAIN


def _estimator(name: str):
  return function_registry.get_advantage_estimator(name)


def test_registered_maxrl_estimators_are_sera_jax_on_tunix_groups():
  rewards = (np.random.default_rng(0).uniform(size=6 * N0) < 0.3).astype(np.float32)
  groups = rewards.reshape(-1, N0)
  for name in ("maxrl", "maxrl_plain"):
    got = _estimator(name)(rewards=rewards, num_generations=N0)
    want = sera_jax.advantages(groups, np.ones(groups.shape, bool), estimator=name)
    np.testing.assert_array_equal(got, np.asarray(want).reshape(-1))


def test_tunix_grpo_is_our_sample_std_grpo():
  rewards = (np.random.default_rng(1).uniform(size=8 * N0) < 0.5).astype(np.float32)
  tunix = _estimator("grpo")(rewards=rewards, num_generations=N0)
  ours = sera_jax.flat_advantages(rewards, np.repeat(np.arange(8), N0), num_prompts=8,
                                  estimator="grpo_sample_std")
  np.testing.assert_allclose(ours, tunix, rtol=1e-6, atol=1e-6)
  assert not np.allclose(ours, sera_jax.flat_advantages(
      rewards, np.repeat(np.arange(8), N0), num_prompts=8, estimator="grpo"))


def test_sera_config_rejects_bad_values():
  with pytest.raises(ValueError, match="allocation must be one of"):
    sera_llm.SeraConfig(num_generations=N0, dataset_size=16, allocation="greedy")
  with pytest.raises(ValueError, match="dataset_size must be >= 1"):
    sera_llm.SeraConfig(num_generations=N0)
  with pytest.raises(ValueError, match="num_iterations must be 1"):
    sera_llm.SeraConfig(num_generations=N0, dataset_size=16, num_iterations=2)


def test_the_learner_passes_a_batch_by_return_values_not_thread_locals():
  """Tunix prepares training data in an executor thread and evaluation data on the main one; a
  batch's rewards, lengths and completions go back to the learner as return values."""
  imported = set()
  for node in ast.walk(ast.parse(inspect.getsource(sera_llm))):
    if isinstance(node, ast.Import):
      imported.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      imported.add(node.module)
  assert "tunix.rl.grpo" in imported  # the walk sees the module's imports
  assert not imported & {"threading", "contextvars"}, imported


def test_another_tunix_version_warns_in_one_line_what_to_rerun(monkeypatch):
  tested = tunix_compat.TESTED_VERSION
  monkeypatch.setattr(importlib.metadata, "version",
                      lambda name: "0.1.99" if name == "google-tunix" else "0")
  with pytest.warns(tunix_compat.TunixVersionWarning) as caught:
    tunix_compat.check_version()
  (message,) = [str(warning.message) for warning in caught]
  assert "\n" not in message
  assert f"google-tunix {tested}'s internals" in message and "0.1.99 is installed" in message
  assert "tests/test_llm_exact.py" in message and f"google-tunix=={tested}" in message
  monkeypatch.setattr(importlib.metadata, "version", lambda name: tested)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    tunix_compat.check_version()  # the tested version: silent


def test_batches_cover_each_problem_once_an_epoch_in_a_fresh_seeded_order():
  columns = {"prompts": np.array([f"q{i}" for i in range(10)]),
             "answer": np.arange(10).astype(str), "idx": np.arange(10)}
  stream = sera_llm.epoch_batches(columns, 3, seed=1)
  first, second = ([next(stream) for _ in range(3)] for _ in range(2))  # 3 batches an epoch
  for epoch in (first, second):
    ids = np.concatenate([batch["idx"] for batch in epoch])
    assert len(set(ids)) == 9  # one problem left over each epoch
    for batch in epoch:
      np.testing.assert_array_equal(batch["prompts"], np.char.add("q", batch["idx"].astype(str)))
  assert not np.array_equal(first[0]["idx"], second[0]["idx"])
  np.testing.assert_array_equal(next(sera_llm.epoch_batches(columns, 3, seed=1))["idx"],
                                first[0]["idx"])
  with pytest.raises(ValueError, match=r"batch_size must lie in \[1, 10\]"):
    next(sera_llm.epoch_batches(columns, 11, seed=1))


def _prepared(learner):
  """Sets the micro-batch sizes `train()` would (its rollouts are one batch of B)."""
  learner._rollout_micro_batch_size = M
  learner._compute_logps_micro_batch_size = M
  return learner


def _in_epoch_two(learner):
  """`learner` in epoch 2 of a population it has seen, which SERA allocates unevenly: every
  prompt's history holds 8 rollouts, their successes spread from 0 to 8."""
  successes = np.linspace(0.0, 8.0, tiny.DATASET_SIZE).astype(np.float32)
  learner.historical = learner.historical._replace(
      successes=jnp.asarray(successes), failures=jnp.asarray(8.0 - successes),
      seen=jnp.ones(tiny.DATASET_SIZE, bool))
  learner.batches_seen = 1
  return learner


def _loss_and_grads(cluster, learner, example):
  loss_fn = function_registry.get_policy_loss_fn(learner.algo_config.policy_loss_fn)
  tokenizer = cluster.tokenizer

  def loss(model):
    return loss_fn(model, example, algo_config=learner.algo_config, pad_id=tokenizer.pad_id(),
                   eos_id=tokenizer.eos_id())

  (value, _), grads = nnx.value_and_grad(loss, has_aux=True)(cluster.actor_trainer.model)
  return value, jax.tree.leaves(nnx.state(grads, nnx.Param))


@pytest.mark.slow
@pytest.mark.parametrize("stock_estimator, ours", [("maxrl", "maxrl"),
                                                   ("grpo", "grpo_sample_std")])
def test_uniform_learner_equals_tunix_grpo_learner_on_the_same_rollouts(stock_estimator, ours):
  """Same batch, same weights, same sampler seed: the same rollouts and advantages. Tunix's
  stock learner leaves each rollout's EOS out of its loss; ours trains it (the EOS goes back
  after the sampled tokens of every rollout that stopped), and with the stock rows given the
  same EOS, the two losses and gradients are equal."""
  batch = tiny.dataset(1, M)[0]
  stock_cluster, our_cluster = tiny.cluster(1), tiny.cluster(1)
  stock = _prepared(grpo_learner.GRPOLearner(
      stock_cluster, grpo_learner.GRPOConfig(
          num_generations=N0, beta=0.0, advantage_estimator=stock_estimator,
          policy_loss_fn=sera_llm.BUDGET_NORM_LOSS, loss_agg_mode=sera_llm.TOKEN_SUM_NORM),
      tiny.slack_reward))
  learner = _prepared(sera_llm.SeraLearner(
      our_cluster, sera_llm.SeraConfig(num_generations=N0, allocation="uniform",
                                       estimator=ours, dataset_size=tiny.DATASET_SIZE),
      tiny.slack_reward))
  repeated = jax.tree.map(lambda v: np.repeat(v, N0, axis=0), batch)
  limit = our_cluster.cluster_config.rollout_config.max_tokens_to_generate
  with jax.set_mesh(tiny.mesh()):
    want = stock._generate_and_compute_advantage(repeated, TRAIN)
    (got,) = learner._process_accumulated_batches([batch], [M], TRAIN)
    stock_lengths = np.asarray(want.completion_mask).sum(axis=1)
    stopped = stock_lengths < limit
    assert stopped.any() and not stopped.all()  # both kinds of rollout in the batch
    rows = np.arange(len(stopped))
    with_eos = np.asarray(want.completion_ids).copy()
    with_eos[rows[stopped], stock_lengths[stopped]] = tiny.CharTokenizer.EOS
    np.testing.assert_array_equal(got.completion_ids, with_eos)
    np.testing.assert_array_equal(np.asarray(got.completion_mask).sum(axis=1),
                                  stock_lengths + stopped)
    assert 0 < float(jnp.mean(learner.last_rewards)) < 1  # mixed groups: nonzero advantages
    np.testing.assert_allclose(got.advantages, want.advantages, rtol=1e-6, atol=1e-6)
    loss, grads = _loss_and_grads(our_cluster, learner, got)
    want_loss, want_grads = _loss_and_grads(
        stock_cluster, stock, want.replace(completion_ids=got.completion_ids,
                                           completion_mask=got.completion_mask))
    stock_loss, _ = _loss_and_grads(stock_cluster, stock, want)
  assert abs(float(stock_loss) - float(loss)) > 1e-4  # the EOS terms change the loss
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6, atol=1e-8)
  assert float(jnp.max(jnp.abs(jnp.concatenate([g.ravel() for g in want_grads])))) > 0
  for g, w in zip(grads, want_grads, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


def test_sera_config_checks_the_generation_batch():
  with pytest.raises(ValueError, match="multiple of num_generations"):
    sera_llm.SeraConfig(num_generations=N0, dataset_size=16, generation_batch_size=6,
                        rollout_seed=0)
  with pytest.raises(ValueError, match="needs a rollout_seed"):
    sera_llm.SeraConfig(num_generations=N0, dataset_size=16, generation_batch_size=8)
  with pytest.raises(ValueError, match="must divide the batch_size"):
    tiny.cluster(1, train_micro_batch_size=3)


@pytest.mark.slow
def test_generation_and_training_in_chunks_still_allocate_over_the_whole_batch():
  """B = 16 generated 8 at a time, each chunk with its own key, and trained 2 prompts'
  rollouts at a time: one allocation of the 4 prompts and one optimizer step a batch."""
  cluster = tiny.cluster(2, train_micro_batch_size=2)
  chunks, keys = [], []
  generate, sample = cluster.generate, cluster.rollout.generate

  def recording(prompts, **kwargs):
    chunks.append((len(prompts), kwargs["micro_batch_size"]))
    return generate(prompts, **kwargs)

  def sampling(prompts, rollout_config, **kwargs):
    keys.append(np.asarray(jax.random.key_data(rollout_config.seed)).tobytes())
    return sample(prompts, rollout_config, **kwargs)

  cluster.generate, cluster.rollout.generate = recording, sampling
  learner = sera_llm.SeraLearner(
      cluster, sera_llm.SeraConfig(num_generations=N0, n_max=tiny.N_MAX,
                                   dataset_size=tiny.DATASET_SIZE, generation_batch_size=8,
                                   rollout_seed=3),
      tiny.slack_reward)
  with jax.set_mesh(tiny.mesh()):
    learner.train(tiny.dataset(2, M))
  assert chunks == [(M * N0, 8)] * 2
  assert len(keys) == 4 and len(set(keys)) == 4  # 2 batches x 2 chunks, no key repeated
  assert learner.batches_seen == 2 and learner.last_counts.shape == (M,)
  assert cluster.actor_trainer.train_steps == 2
  assert len(cluster.actor_trainer.metrics_logger.get_metric_history("actor", "loss",
                                                                     "train")) == 2


@pytest.fixture
def allocations(monkeypatch):
  """Every training batch's (estimated log p, counts), as the learner reports them."""
  recorded = []
  process = sera_llm.SeraLearner._process_accumulated_batches

  def recording(self, micro_batches, micro_batch_sizes, mode):
    produced = process(self, micro_batches, micro_batch_sizes, mode)
    if mode == TRAIN and produced:
      recorded.append((self.last_log_p, self.last_counts))
    return produced

  monkeypatch.setattr(sera_llm.SeraLearner, "_process_accumulated_batches", recording)
  return recorded


@pytest.mark.slow
def test_sera_trains_a_tiny_decoder_and_resumes_with_the_same_estimator_and_counts(
    tmp_path, allocations):
  """An uninterrupted 8-step run against one SIGKILLed while it waits after the checkpoint of
  step 4 (it says so on stdout), then resumed: the kill point is observed, not timed."""
  killed_dir = tmp_path / "killed"
  process = subprocess.Popen(
      [sys.executable, str(pathlib.Path(__file__).with_name("llm_paused_run.py")),
       str(killed_dir), "4"],
      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  # A child stuck before its checkpoint would hang the test; killed, it ends the read below.
  watchdog = threading.Timer(900, process.kill)
  watchdog.start()
  try:
    whole = tiny.train_sera(8, str(tmp_path / "whole"))
    for line in process.stdout:  # up to the line the waiting child prints, or its end
      if "checkpointed 4" in line:  # another writer's partial line may precede it
        break
    else:
      pytest.fail("the paused run ended without reaching its checkpoint of step 4")
  finally:
    watchdog.cancel()
    process.kill()
    process.wait()
  whole_steps = list(allocations)
  assert len(whole_steps) == 8
  logged = whole.rl_cluster.actor_trainer.metrics_logger  # beside Tunix's own (actor/loss, ...)
  np.testing.assert_array_equal(logged.get_metric_history("rollouts", "max", "train"),
                                [counts.max() for _, counts in whole_steps])
  for prefix, name in (("global", "active_fraction"), ("global", "useful_group_fraction"),
                       ("kappa_estimate", "spread"), ("p_estimate", "mean"), ("actor", "loss")):
    assert len(logged.get_metric_history(prefix, name, "train")) == 8, (prefix, name)
  allocations.clear()
  resumed = tiny.train_sera(8, str(killed_dir))
  assert len(allocations) == 4  # steps 5..8, from the checkpoint of step 4
  assert resumed.batches_seen == whole.batches_seen == 8
  for (log_p, counts), (want_log_p, want_counts) in zip(
      allocations, whole_steps[8 - len(allocations):], strict=True):
    assert counts.sum() == M * N0
    np.testing.assert_array_equal(counts, want_counts)
    np.testing.assert_allclose(log_p, want_log_p, rtol=1e-6)
  for got, want in zip(resumed.historical, whole.historical, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-6)
  # Epoch 2 (steps 4..7) allocates on the frozen estimate: exactly sera_jax.allocate's counts,
  # and unevenly (the slack reward makes some prompts far easier than others).
  for log_p, counts in whole_steps[4:]:
    want = sera_jax.allocate(log_p, baseline_n=N0, n_min=2, n_max=tiny.N_MAX).counts
    np.testing.assert_array_equal(counts, want)
  assert any(counts.max() > N0 for _, counts in whole_steps[4:])
  assert all((counts == N0).all() for _, counts in whole_steps[:4])  # first epoch: uniform


def _learner_on(checkpoint_dir, dataset_size=tiny.DATASET_SIZE):
  return sera_llm.SeraLearner(
      tiny.cluster(4, checkpoint_dir=str(checkpoint_dir)),
      sera_llm.SeraConfig(num_generations=N0, n_max=tiny.N_MAX, dataset_size=dataset_size,
                          rollout_seed=0),
      tiny.slack_reward)


def _checkpoint(learner, step):
  trainer = learner.rl_cluster.actor_trainer
  trainer.checkpoint_manager.save(step, trainer.model, force=True)
  trainer.checkpoint_manager.close()  # waits for Orbax's asynchronous save


@pytest.mark.slow  # builds and runs a Tunix cluster: 10-40 s here
def test_the_estimator_and_its_counters_are_restored_from_the_actor_checkpoint(tmp_path):
  """The estimator is in the checkpoint's own metadata (finalized with it by one rename), and
  the evaluation counter comes back too, so a resumed run draws the keys an unbroken one does."""
  saved = _learner_on(tmp_path)
  saved.batches_seen, saved._evaluations = 3, 5
  saved.historical = saved.historical._replace(
      successes=jnp.arange(tiny.DATASET_SIZE, dtype=jnp.float32) / 3,
      seen=jnp.arange(tiny.DATASET_SIZE) % 2 == 0)
  _checkpoint(saved, 2)
  assert not list(tmp_path.glob("sera_estimator*"))  # no file of its own beside the checkpoint
  restored = _learner_on(tmp_path)
  assert (restored.batches_seen, restored._evaluations) == (3, 5)
  for got, want in zip(restored.historical, saved.historical, strict=True):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(restored._batch_key(rl_cluster_lib.Mode.EVAL),
                                saved._batch_key(rl_cluster_lib.Mode.EVAL))


@pytest.mark.slow  # builds and runs a Tunix cluster: 10-40 s here
def test_a_checkpoint_without_the_estimator_or_of_another_dataset_is_refused(tmp_path):
  stock = grpo_learner.GRPOLearner(tiny.cluster(4, checkpoint_dir=str(tmp_path / "stock")),
                                   grpo_learner.GRPOConfig(num_generations=N0),
                                   tiny.slack_reward)
  _checkpoint(stock, 2)
  with pytest.raises(ValueError, match=r"^the actor checkpoint of step 2 in .*stock holds no "
                                       r"SERA estimator state .*new checkpoint directory\.$"):
    _learner_on(tmp_path / "stock")
  _checkpoint(_learner_on(tmp_path / "sera"), 2)
  with pytest.raises(ValueError, match=r"holds the estimator of 16 prompts, but dataset_size "
                                       r"is 32"):
    _learner_on(tmp_path / "sera", dataset_size=32)


def _uniform_learner(reward_fns, **config):
  return _prepared(sera_llm.SeraLearner(
      tiny.cluster(1), sera_llm.SeraConfig(num_generations=N0, n_max=tiny.N_MAX,
                                           dataset_size=tiny.DATASET_SIZE, **config),
      reward_fns))


@pytest.mark.slow  # builds and runs a Tunix cluster: 10-40 s here
@pytest.mark.parametrize("reward_fns, bad", [
    (lambda prompts, completions, **unused: [0.5] * len(prompts), "0.5"),
    ([tiny.slack_reward, lambda prompts, completions, **unused: [1.0] * len(prompts)], "2.0"),
])
def test_non_binary_rewards_are_refused_before_the_jitted_steps(reward_fns, bad):
  """A reward of 0.5, or 2 from a list of reward functions (Tunix sums them), would be staged
  and used as is inside the jitted steps."""
  learner = _uniform_learner(reward_fns)
  with jax.set_mesh(tiny.mesh()), pytest.raises(ValueError, match=f"binary rewards.*{bad}"):
    learner._process_accumulated_batches([tiny.dataset(1, M)[0]], [M], TRAIN)


@pytest.mark.slow  # builds a Tunix cluster: up to a minute on a loaded machine
def test_dataset_indices_outside_the_dataset_are_refused():
  """Index 16 of 16 prompts would silently read prompt 15's estimate inside jit."""
  learner = _uniform_learner(tiny.slack_reward)
  batch = dict(tiny.dataset(1, M)[0])
  batch["idx"] = batch["idx"].copy()
  batch["idx"][1] = tiny.DATASET_SIZE
  with jax.set_mesh(tiny.mesh()), pytest.raises(ValueError, match=r"'idx' must hold integer "
                                                                   r"dataset indices in \[0, "
                                                                   r"dataset_size = 16\)"):
    learner._process_accumulated_batches([batch], [M], TRAIN)


@pytest.mark.slow  # builds and runs a Tunix cluster: 10-40 s here
def test_an_unseen_prompt_gets_the_population_mean_and_the_batch_keeps_sera():
  """Epoch 2 with one prompt of the batch never seen (an epoch's leftover): its log p is the
  mean estimate over the seen prompts, and the batch is allocated by SERA, not uniformly."""
  learner = _uniform_learner(tiny.slack_reward)
  batch = tiny.dataset(1, M)[0]
  size = tiny.DATASET_SIZE
  successes = np.linspace(0.0, 8.0, size).astype(np.float32)
  seen = np.ones(size, bool)
  seen[batch["idx"][2]] = False
  learner.historical = learner.historical._replace(
      successes=jnp.asarray(successes), failures=jnp.asarray(8.0 - successes),
      seen=jnp.asarray(seen))
  learner.batches_seen = 1  # within an epoch: no boundary folds the state now
  with jax.set_mesh(tiny.mesh()):
    learner._process_accumulated_batches([batch], [M], TRAIN)
  estimate = (0.5 + successes) / 9.0
  want_log_p = np.log(estimate[batch["idx"]])
  want_log_p[2] = np.log(estimate[seen].mean())
  np.testing.assert_allclose(learner.last_log_p, want_log_p, rtol=1e-5)
  want = sera_jax.allocate(want_log_p, baseline_n=N0, n_min=2, n_max=tiny.N_MAX).counts
  np.testing.assert_array_equal(learner.last_counts, want)
  assert not (learner.last_counts == N0).all()


def test_sera_config_refuses_what_it_would_ignore():
  with pytest.raises(ValueError, match="leave advantage_estimator at its default"):
    sera_llm.SeraConfig(num_generations=N0, dataset_size=16, advantage_estimator="grpo")
  with pytest.raises(ValueError, match="log_p_source must be one of"):
    sera_llm.SeraConfig(num_generations=N0, dataset_size=16, log_p_source="oracle")
  with pytest.raises(ValueError, match="align_every needs exact_log_p"):
    sera_llm.SeraConfig(num_generations=N0, dataset_size=16, align_every=1)


def _tunix_cluster(**training):
  """The tiny decoder's cluster built through Tunix's own config, as a Tunix user would
  build one, with the given RLTrainingConfig keys (micro-batching, packing)."""
  roles = (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
  config = rl_cluster_lib.ClusterConfig(
      role_to_mesh=dict.fromkeys(roles, tiny.mesh()), rollout_engine="vanilla",
      training_config=rl_cluster_lib.RLTrainingConfig(
          actor_optimizer=optax.adam(1e-2), eval_every_n_steps=10_000_000, max_steps=1,
          **training),
      rollout_config=tiny.rollout_config())
  with jax.set_mesh(tiny.mesh()):
    return rl_cluster_lib.RLCluster(actor=tiny.decoder(), tokenizer=tiny.CharTokenizer(),
                                    cluster_config=config)


def _sera_learner(cluster, **kwargs):
  return sera_llm.SeraLearner(
      cluster, sera_llm.SeraConfig(num_generations=N0, n_max=tiny.N_MAX,
                                   dataset_size=tiny.DATASET_SIZE),
      tiny.slack_reward, **kwargs)


def test_one_process_per_host_is_refused_naming_pathways(monkeypatch):
  """Tunix's RL path runs under one controller (Pathways on a multi-host slice); its sampler
  fails on arrays another process holds. Refused before the cluster is touched."""
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  with pytest.raises(RuntimeError, match=r"^SeraLearner needs one controller process that sees "
                                         r"every device: run a multi-host slice through "
                                         r"Pathways; this is process 1 of 2[^\n]*$"):
    _sera_learner(cluster=None)


@pytest.mark.slow  # builds and runs a Tunix cluster: 10-40 s here
@pytest.mark.parametrize("training, refused", [
    (dict(mini_batch_size=2, train_micro_batch_size=2),
     r"mini_batch_size = 2 would make 2 steps of it: leave mini_batch_size None"),
    (dict(mini_batch_size=M, train_micro_batch_size=2),
     r"would hand the learner 2 at a time \(the least common multiple of "
     r"rollout_micro_batch_size = 2 and compute_logps_micro_batch_size = 2"),
    (dict(rollout_micro_batch_size=1, compute_logps_micro_batch_size=2),
     r"would hand the learner 2 at a time .*set rollout_micro_batch_size to the batch size"),
])
def test_micro_batches_that_split_the_batch_are_refused_before_generating(training, refused):
  """Each setting would have `_process_accumulated_batches` allocate over part of the M
  prompts (or update the actor after part of them): refused at the first step, in one line."""
  learner = _sera_learner(_tunix_cluster(**training))
  generated = []
  learner.rl_cluster.generate = lambda *args, **kwargs: generated.append(args)
  with jax.set_mesh(tiny.mesh()), pytest.raises(ValueError, match=refused) as error:
    learner.train(tiny.dataset(1, M))
  assert "\n" not in str(error.value) and not generated


@pytest.mark.slow  # builds and runs a Tunix cluster: 10-40 s here
def test_sequence_packing_is_refused():
  """Packing regroups rollouts into rows, which breaks the loss's 1/B normalisation."""
  with pytest.raises(ValueError, match=r"^SeraLearner divides each train micro-batch's loss by "
                                       r"its rows .*leave max_seq_token_per_tpu None \(got "
                                       r"64\)\.$"):
    _sera_learner(_tunix_cluster(max_seq_token_per_tpu=64))


@pytest.mark.slow  # builds and runs a Tunix cluster: 10-40 s here
def test_metric_fns_get_seras_advantages_and_prompt_mean_weighs_prompts_equally():
  """Tunix's GRPO learner calls metric_fns with its own advantages; SeraLearner calls them
  with the advantages its loss trains. rewards/prompt_mean is the mean over the prompts of
  each one's success rate, where Tunix's rewards/score/mean is the mean over rollouts."""
  calls = []

  def metric_fn(prompts, completions, advantages, rewards, idx, **unused):
    calls.append((list(prompts), list(completions), np.asarray(advantages),
                  np.asarray(rewards), np.asarray(idx)))
    return {"custom/rollouts": (len(prompts), np.mean)}

  learner = _in_epoch_two(_prepared(_sera_learner(tiny.cluster(1), metric_fns=[metric_fn])))
  batch = tiny.dataset(1, M)[0]
  with jax.set_mesh(tiny.mesh()):
    (example,) = learner._process_accumulated_batches([batch], [M], TRAIN)
  counts, rewards = learner.last_counts, learner.last_rewards
  assert not (counts == N0).all() and 0 < rewards.mean() < 1
  (prompts, completions, advantages, got_rewards, idx), = calls
  np.testing.assert_array_equal(advantages, example.advantages)
  assert np.abs(advantages).max() > 0
  np.testing.assert_array_equal(got_rewards, rewards)
  np.testing.assert_array_equal(idx, np.repeat(batch["idx"], counts))
  assert prompts == np.repeat(batch["prompts"], counts).tolist() and len(completions) == M * N0
  buffered = learner.rl_cluster._buffered_train_metrics[-1].metrics
  segments = np.repeat(np.arange(M), counts)
  sampled = counts > 0
  rates = np.bincount(segments, rewards, minlength=M)[sampled] / counts[sampled]
  np.testing.assert_allclose(buffered["rewards/prompt_mean"][0], [rates.mean()], rtol=1e-6)
  np.testing.assert_allclose(buffered["rewards/score/mean"][0], [rewards.mean()], rtol=1e-6)
  assert buffered["custom/rollouts"][0] == [M * N0]


@pytest.mark.slow  # builds and runs a Tunix cluster: 10-40 s here
def test_a_rematerialised_decoder_generates_with_remat_off():
  """Tunix's sampler cannot trace an nnx.remat layer inside its decode loop (a
  TraceContextError), and a config such as GSM8K's remats every decoder layer: the learner
  generates with remat off and leaves it on for the training steps."""
  actor = tiny.decoder()
  actor.config.remat_config = qwen2.RematConfig.DECODER  # one config all its layers read
  cluster = cluster_lib.build(actor, tiny.CharTokenizer(), tiny.mesh(),
                              optimizer=optax.adam(1e-2), max_steps=1,
                              rollout_config=tiny.rollout_config())
  learner = _prepared(_sera_learner(cluster))
  with jax.set_mesh(tiny.mesh()):
    (example,) = learner._process_accumulated_batches([tiny.dataset(1, M)[0]], [M], TRAIN)
  assert example.completion_ids.shape[0] == M * N0
  assert cluster.actor_trainer.model.config.remat_config == qwen2.RematConfig.DECODER


def test_the_tiny_command_reads_a_mesh_shape(capsys):
  with pytest.raises(SystemExit):
    tiny.main(["--mesh", "2"])
  assert "expected FSDP,TP, two positive integers; got '2'" in capsys.readouterr().err
  with pytest.raises(ValueError, match=r"an \(fsdp, tp\) = \(2, 4\) mesh needs 8 devices; got 1"):
    tiny.mesh((2, 4))
