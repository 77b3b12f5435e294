"""A Monte Carlo bias test of the whole LLM path: Tunix's rollouts, rewards and loss in SeraLearner.

For a fixed policy and batch, the mean over R independent rollout draws of the realized
gradient (minus the gradient of the loss Tunix trains on: the budget-normalised policy loss
over the train micro-batches, SERA's weights folded into the flat advantages) must equal the
closed form g_E = (1/M) sum_q (w_q n_q / N0) c(p_q, n_q) grad log p_q
(docs/method.md#weights-and-the-loss), with p_q the task's exact, teacher-forced success
probability.

The statistic: the realized gradient is projected on D fixed unit directions (D - 1 random
ones and g_E's own); each projection's mean over the R draws gives
z = (mean - <g_E, d>) / (std / sqrt(R)). Every |z| must be below 4.5: for a normal mean
that is a false alarm in about 7e-6 of the projections, about 2e-4 for the whole test's
4 x D projections. The same draws, scored without each rollout's EOS as Tunix's stock
learner scores them, must fail it.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from tunix.rl import rl_cluster as rl_cluster_lib

import sera_jax
from sera_jax.settings.llm import arithmetic, tiny
from sera_jax.settings.llm import cluster as cluster_lib
from sera_jax.settings.llm import learner as sera_llm

M, N0, N_MAX, DIGITS = 4, 4, 16, 1
DRAWS, DIRECTIONS, Z_LIMIT = 400, 8, 4.5
TRAIN = rl_cluster_lib.Mode.TRAIN


@pytest.fixture(scope="module")
def problems_and_policy():
  """Four one-digit sums and a decoder warm-started briefly on them: p spread in (0.05, 0.9)."""
  problems = arithmetic.split({"train": M}, digits=DIGITS, seed=0)["train"]
  model = tiny.decoder(0)
  arithmetic.warm_start(model, problems, steps=WARM_START_STEPS, batch_size=M,
                        learning_rate=1e-2, seed=0)
  return problems, model


WARM_START_STEPS = 8  # p = 0.09, 0.14, 0.64, 0.75 (40 steps would memorise all four)


def _learner(model, allocation: str, estimator: str, *, align_every: int = 0,
             max_steps: int = 1) -> sera_llm.SeraLearner:
  """SeraLearner on the exact p (so counts are fixed) of a copy of `model` (SGD at rate 0)."""
  actor = tiny.decoder(0)
  nnx.update(actor, nnx.state(model, nnx.Param))
  cluster = cluster_lib.build(actor, arithmetic.TOKENIZER, tiny.mesh(), optimizer=optax.sgd(0.0),
                              max_steps=max_steps,
                              rollout_config=arithmetic.rollout_config(DIGITS))
  learner = sera_llm.SeraLearner(
      cluster, sera_llm.SeraConfig(num_generations=N0, n_max=N_MAX, dataset_size=M,
                                   allocation=allocation, estimator=estimator, rollout_seed=7,
                                   log_p_source=arithmetic.batch_log_p,
                                   exact_log_p=arithmetic.batch_log_p, align_every=align_every),
      arithmetic.exact_reward)
  learner._rollout_micro_batch_size = learner._compute_logps_micro_batch_size = M
  return learner


def _z_scores(projections: np.ndarray, target: np.ndarray) -> np.ndarray:
  return (projections.mean(0) - target) / (projections.std(0, ddof=1) / np.sqrt(len(projections)))


@pytest.mark.slow
@pytest.mark.parametrize("allocation, estimator", [("sera", "maxrl"), ("uniform", "maxrl"),
                                                   ("sera", "rloo"), ("uniform", "rloo")])
def test_the_realized_gradient_through_tunix_is_unbiased_for_the_closed_form(
    problems_and_policy, allocation, estimator):
  problems, model = problems_and_policy
  batch = problems.columns()
  learner = _learner(model, allocation, estimator)
  log_p = np.asarray(arithmetic.batch_log_p(model, batch))
  assert (0.05 < np.exp(log_p)).all() and (np.exp(log_p) < 0.9).all(), np.exp(log_p)
  alloc = sera_jax.allocate(log_p, baseline_n=N0, n_min=2, n_max=N_MAX, mode=allocation)
  with jax.set_mesh(tiny.mesh()):
    expected = np.asarray(learner.expected_gradients(batch, alloc)[1])
    rng = np.random.default_rng(0)
    directions = rng.normal(size=(DIRECTIONS, expected.size))
    directions[0] = expected
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    trained, without_eos = [], []
    for _ in range(DRAWS):
      (example,) = learner._process_accumulated_batches([batch], [M], TRAIN)
      trained.append(directions @ np.asarray(learner.realized_gradient([example])))
      stock_mask = example.completion_mask * (example.completion_ids != tiny.CharTokenizer.EOS)
      without_eos.append(directions @ np.asarray(
          learner.realized_gradient([example.replace(completion_mask=stock_mask)])))
  np.testing.assert_array_equal(learner.last_counts, alloc.counts)
  if allocation == "sera":
    assert len(set(alloc.counts.tolist())) > 1  # uneven counts
  target = directions @ expected
  z = _z_scores(np.array(trained), target)
  z_without_eos = _z_scores(np.array(without_eos), target)
  print(f"{allocation}/{estimator}: p = {np.round(np.exp(log_p), 3)}, counts = {alloc.counts}, "
        f"z = {np.round(z, 2)}, without EOS z = {np.round(z_without_eos, 2)}")
  assert np.abs(z).max() < Z_LIMIT, z
  assert np.abs(z_without_eos).max() > Z_LIMIT, z_without_eos


@pytest.mark.slow
@pytest.mark.parametrize("allocation, align_every, steps, aligned_steps", [
    ("uniform", 1, 2, 2), ("sera", 2, 3, 2)])
def test_training_logs_alignment_with_the_exact_gradient(problems_and_policy, allocation,
                                                         align_every, steps, aligned_steps):
  """Every align_every-th batch logs the classification setting's cosines and norm ratios
  beside Tunix's own metrics; uniform counts make the expected gradient uniform MaxRL's."""
  problems, model = problems_and_policy
  learner = _learner(model, allocation, "maxrl", align_every=align_every, max_steps=steps)
  with jax.set_mesh(tiny.mesh()):
    learner.train([problems.columns()] * steps)
  logged = learner.rl_cluster.actor_trainer.metrics_logger
  history = {(prefix, name): np.asarray(logged.get_metric_history(prefix, name, "train"))
             for prefix in ("cos", "norm_ratio")
             for name in ("realized", "expected", "uniform_expected")}
  history["exact_log_p", "mean"] = np.asarray(
      logged.get_metric_history("exact_log_p", "mean", "train"))
  for key, values in history.items():
    assert values.shape == (aligned_steps,) and np.isfinite(values).all(), key
  for name in ("realized", "expected", "uniform_expected"):
    assert (np.abs(history["cos", name]) <= 1 + 1e-6).all()
  assert (history["cos", "expected"] > 0.5).all()  # every kappa > 0: a positive combination
  if allocation == "uniform":
    np.testing.assert_allclose(history["cos", "expected"], history["cos", "uniform_expected"],
                               rtol=1e-5)
  np.testing.assert_allclose(  # SGD at rate 0: the policy and so its exact log p stay put
      history["exact_log_p", "mean"],
      float(np.mean(arithmetic.batch_log_p(model, problems.columns()))), rtol=1e-5)
  assert learner.last_alignment is not None
