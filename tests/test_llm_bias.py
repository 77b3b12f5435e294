"""A Monte Carlo bias test of the whole LLM path: Tunix's rollouts, rewards and loss in SeraLearner.

For a fixed policy and batch, the mean over R independent rollout draws of the realized
gradient (minus the gradient of the loss Tunix trains on: the budget-normalised policy loss,
SERA's weights folded into the flat advantages, over two train micro-batches whose gradients
are averaged as Tunix's optimizer accumulates them) must equal the closed form
g_E = (1/M) sum_q (w_q n_q / N0) c(p_q, n_q) grad log p_q (docs/method.md#weights-and-the-loss),
with p_q the task's exact, teacher-forced success probability and c written out here:
kappa(p, n) = 1 - (1 - p)^(n - 1) for MaxRL and p for RLOO.

The statistic (`sera_jax.testing.monte_carlo_bias`): the realized gradient is projected on D
fixed directions (g_E's own and D - 1 random ones, fixed before drawing); each projection's
mean over the R draws gives z = (mean - <g_E, d>) / (std / sqrt(R)), and every |z| must stay
below Student's t quantile at a family-wise false-alarm rate of 1e-4. The same draws scored
without each rollout's stop token (as Tunix's stock learner scores them), and, for SERA's
uneven counts, without the prompt weights w_q, must fail it.
"""

import jax
import jax.flatten_util
import numpy as np
import optax
import pytest
from flax import nnx
from tunix.rl import rl_cluster as rl_cluster_lib

import sera_jax
from sera_jax import testing
from sera_jax.settings.llm import arithmetic, tiny
from sera_jax.settings.llm import cluster as cluster_lib
from sera_jax.settings.llm import learner as sera_llm

M, N0, N_MAX, DIGITS = 4, 4, 16, 1
MICRO = 2  # prompts a train micro-batch: B = 16 rollouts trained in 2 micro-batches of 8
DRAWS, DIRECTIONS, FALSE_ALARM = 400, 8, 1e-4
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
             max_steps: int = 1, micro: int | None = None,
             learning_rate: float = 0.0) -> sera_llm.SeraLearner:
  """SeraLearner on the exact p (so counts are fixed) of a copy of `model` (SGD at
  `learning_rate`), training `micro` prompts' rollouts at a time (None: the whole batch)."""
  actor = tiny.decoder(0)
  nnx.update(actor, nnx.state(model, nnx.Param))
  cluster = cluster_lib.build(actor, arithmetic.TOKENIZER, tiny.mesh(),
                              optimizer=optax.sgd(learning_rate), max_steps=max_steps,
                              rollout_config=arithmetic.rollout_config(DIGITS),
                              batch_size=None if micro is None else M,
                              train_micro_batch_size=micro)
  learner = sera_llm.SeraLearner(
      cluster, sera_llm.SeraConfig(num_generations=N0, n_max=N_MAX, dataset_size=M,
                                   allocation=allocation, estimator=estimator, rollout_seed=7,
                                   log_p_source=arithmetic.batch_log_p,
                                   exact_log_p=arithmetic.batch_log_p, align_every=align_every),
      arithmetic.exact_reward)
  learner._rollout_micro_batch_size = learner._compute_logps_micro_batch_size = M
  return learner


def _kappa(estimator: str, p: np.ndarray, n: np.ndarray) -> np.ndarray:
  """c(p, n): E[sum of a group's A_i grad log pi(y_i)] = n c(p, n) grad log p."""
  return {"maxrl": 1 - (1 - p) ** (n - 1), "rloo": p}[estimator]


def _closed_form(model, batch, weights, counts, estimator) -> np.ndarray:
  """g_E = (1/M) sum_q (w_q n_q / N0) c(p_q, n_q) grad log p_q, one pullback of the task's
  exact log p with those coefficients, flattened as the realized gradient is."""
  graph, params, rest = nnx.split(model, nnx.Param, ...)
  log_p, pullback = jax.vjp(
      lambda params: arithmetic.batch_log_p(nnx.merge(graph, params, rest), batch), params)
  p = np.exp(np.asarray(log_p, np.float64))
  coefficients = weights * counts / N0 * _kappa(estimator, p, counts) / len(counts)
  (gradient,) = pullback(np.asarray(coefficients, np.float32))
  return np.asarray(jax.flatten_util.ravel_pytree(gradient)[0], np.float64)


def _halves(batch):
  """The batch as Tunix hands it to the learner: train micro-batches of MICRO prompts."""
  return [{key: value[start:start + MICRO] for key, value in batch.items()}
          for start in range(0, M, MICRO)]


@pytest.mark.slow
@pytest.mark.parametrize("allocation, estimator", [("sera", "maxrl"), ("uniform", "maxrl"),
                                                   ("sera", "rloo"), ("uniform", "rloo")])
def test_the_realized_gradient_through_tunix_is_unbiased_for_the_closed_form(
    problems_and_policy, allocation, estimator):
  problems, model = problems_and_policy
  batch = problems.columns()
  learner = _learner(model, allocation, estimator, micro=MICRO)
  log_p = np.asarray(arithmetic.batch_log_p(model, batch))
  assert (0.05 < np.exp(log_p)).all() and (np.exp(log_p) < 0.9).all(), np.exp(log_p)
  alloc = sera_jax.allocate(log_p, baseline_n=N0, n_min=2, n_max=N_MAX, mode=allocation)
  counts, weights = np.asarray(alloc.counts), np.asarray(alloc.weights, np.float64)
  actor = learner.rl_cluster.actor_trainer.model
  with jax.set_mesh(tiny.mesh()):
    expected = _closed_form(actor, batch, weights, counts, estimator)
    # The learner's own expected gradient agrees with the one written out here.
    np.testing.assert_allclose(np.asarray(learner.expected_gradients(batch, alloc)[1]),
                               expected, rtol=1e-3, atol=1e-4 * np.abs(expected).max())
    rng = np.random.default_rng(0)
    directions = rng.normal(size=(DIRECTIONS, expected.size))
    directions[0] = expected
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    row_weights = np.repeat(weights, counts).astype(np.float32)
    size = M * N0 // (M // MICRO)
    draws = {"trained": [], "without stop token": [], "without prompt weights": []}
    for _ in range(DRAWS):
      slices = learner._process_accumulated_batches(_halves(batch), [MICRO] * (M // MICRO),
                                                    TRAIN)
      assert len(slices) == M // MICRO
      variants = {
          "trained": slices,
          "without stop token": [s.replace(completion_mask=s.completion_mask * (
              s.completion_ids != tiny.CharTokenizer.EOS)) for s in slices],
          "without prompt weights": [s.replace(advantages=s.advantages / row_weights[
              i * size:(i + 1) * size]) for i, s in enumerate(slices)]}
      for name, examples in variants.items():
        if name != "without prompt weights" or allocation == "sera":
          draws[name].append(directions @ np.asarray(learner.realized_gradient(examples)))
  np.testing.assert_array_equal(learner.last_counts, counts)
  per_micro_batch = [np.bincount(np.repeat(np.arange(M), counts)[i * size:(i + 1) * size],
                                 minlength=M) for i in range(M // MICRO)]
  reports = {name: testing.monte_carlo_bias(np.array(projected), directions @ expected,
                                            directions=np.eye(DIRECTIONS),
                                            false_alarm=FALSE_ALARM)
             for name, projected in draws.items() if projected}
  print(f"{allocation}/{estimator}: p = {np.round(np.exp(log_p), 3)}, counts = {counts}, "
        f"rollouts of each prompt a micro-batch = {[m.tolist() for m in per_micro_batch]}, "
        + "; ".join(f"{name}: max |z| = {np.abs(r.z).max():.2f} (limit {r.limit:.2f})"
                    for name, r in reports.items()))
  assert reports["trained"].consistent, reports["trained"]
  assert not reports["without stop token"].consistent, reports["without stop token"]
  if allocation == "sera":
    assert len(set(counts.tolist())) > 1  # uneven counts
    assert not reports["without prompt weights"].consistent, reports["without prompt weights"]


@pytest.mark.slow
@pytest.mark.parametrize("micro", [1, MICRO])
def test_the_micro_batched_update_is_the_whole_batch_update(problems_and_policy, micro):
  """Tunix's optimizer step over M / micro train micro-batches (gradients accumulated) moves
  the weights as one step over the whole batch's same rollouts: SGD at rate 1, so the move is
  the gradient itself."""
  problems, model = problems_and_policy
  moves, outcomes = [], []
  for size in (micro, None):
    learner = _learner(model, "sera", "maxrl", micro=size, learning_rate=1.0)
    actor = learner.rl_cluster.actor_trainer.model
    before = jax.flatten_util.ravel_pytree(nnx.state(actor, nnx.Param))[0]
    with jax.set_mesh(tiny.mesh()):
      learner.train([problems.columns()])
    assert learner.rl_cluster.actor_trainer.train_steps == 1
    after = jax.flatten_util.ravel_pytree(nnx.state(actor, nnx.Param))[0]
    moves.append(np.asarray(after - before, np.float64))
    outcomes.append((learner.last_counts, learner.last_rewards))
  for got, want in zip(*outcomes, strict=True):  # the same rollouts
    np.testing.assert_array_equal(got, want)
  assert len(set(outcomes[0][0].tolist())) > 1  # uneven counts across the micro-batches
  scale = np.abs(moves[1]).max()
  assert scale > 1e-4  # a step that moved
  np.testing.assert_allclose(moves[0], moves[1], rtol=1e-5, atol=1e-6 * scale)


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
