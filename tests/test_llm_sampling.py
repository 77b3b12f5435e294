"""SeraLearner trains the law its rollouts sample: the stop token each rollout sampled, no PAD
inside a completion, and only the full softmax at the loss's temperature."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from tunix.models.qwen2 import model as qwen2
from tunix.rl import common
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.rollout import base_rollout

from sera_jax.settings.llm import cluster as cluster_lib
from sera_jax.settings.llm import learner as sera_llm
from sera_jax.settings.llm import tiny, tunix_compat

TOKENIZER = tiny.CharTokenizer
SPACE = TOKENIZER().encode(" ")[0]
TRAIN = rl_cluster_lib.Mode.TRAIN
LIMIT = 4  # tokens a rollout may sample


def _rollout_config(**changes) -> base_rollout.RolloutConfig:
  config = dict(max_tokens_to_generate=LIMIT, max_prompt_length=8, kv_cache_size=32,
                temperature=1.0, top_p=1.0)
  return base_rollout.RolloutConfig(**{**config, **changes})


def _learner(model: nnx.Module, **rollout) -> sera_llm.SeraLearner:
  cluster = cluster_lib.build(model, TOKENIZER(), tiny.mesh(), optimizer=optax.sgd(0.0),
                              max_steps=1, rollout_config=_rollout_config(**rollout))
  learner = sera_llm.SeraLearner(
      cluster, sera_llm.SeraConfig(num_generations=4, dataset_size=tiny.DATASET_SIZE,
                                   rollout_seed=3),
      tiny.slack_reward)
  learner._rollout_micro_batch_size = learner._compute_logps_micro_batch_size = 4
  return learner


def _requests(rows: int) -> dict[str, np.ndarray]:
  (batch,) = tiny.dataset(1, tiny.DATASET_SIZE)
  return {key: np.resize(value, rows) for key, value in batch.items()}


def _pad_emitting_decoder(seed: int) -> qwen2.Qwen2:
  """Tunix's own Qwen2 over the characters, PAD (0, not the EOS) emittable."""
  masked = tiny.decoder(seed)
  return qwen2.Qwen2(masked.config, rngs=nnx.Rngs(seed))


@pytest.mark.slow
@pytest.mark.parametrize("stops", [[SPACE], [SPACE, TOKENIZER.EOS]])
def test_each_stopped_rollout_trains_the_stop_token_it_sampled(stops):
  """eos_tokens other than the tokenizer's EOS, and two of them: each stopped rollout ends with
  a token of the stop set, the one the sampler stopped at, never an appended EOS."""
  learner = _learner(tiny.decoder(0), eos_tokens=stops)
  sampled = []
  generate = learner.rl_cluster.generate
  learner.rl_cluster.generate = lambda **kwargs: sampled.append(generate(**kwargs)) or sampled[-1]
  with jax.set_mesh(tiny.mesh()):
    rollouts = learner.generate_and_score(_requests(64), TRAIN, 64)
  (output,) = sampled
  ids = np.asarray(rollouts.example.completion_ids)
  last = []
  for row, (tokens, length) in enumerate(zip(output.tokens, rollouts.lengths, strict=True)):
    np.testing.assert_array_equal(ids[row, :len(tokens)], tokens)  # what was sampled, first
    assert not np.isin(tokens, stops).any()  # the sampler stops at the first stop token
    if len(tokens) < LIMIT:  # stopped: one token more, trained (masked by length)
      assert length == len(tokens) + 1
      last.append(ids[row, length - 1])
    else:
      assert length == LIMIT
  assert set(last) == set(stops), last  # each stop token ended some rollout, no other did
  mask = np.asarray(rollouts.example.completion_mask)
  assert mask.shape == ids.shape


def _trained_log_probs(learner, example) -> np.ndarray:
  """The per-token log-probabilities the actor's loss computes for `example`: Tunix's
  compute_per_token_logps of the model that loss hands Tunix's GRPO loss."""
  seen = {}
  grpo_loss = sera_llm.algo_core.grpo_loss_fn

  def spy(model, train_example, algo_config, pad_id, eos_id, **kwargs):
    graphdef, state = nnx.split(model)
    seen["log_p"] = common.compute_per_token_logps(
        graphdef, state, prompt_tokens=train_example.prompt_ids,
        completion_tokens=train_example.completion_ids, pad_id=pad_id, eos_id=eos_id,
        temperature=algo_config.temperature)
    return grpo_loss(model, train_example, algo_config, pad_id, eos_id, **kwargs)

  sera_llm.algo_core.grpo_loss_fn = spy
  try:
    tunix_compat.training_loss(learner.rl_cluster.actor_trainer)(
        learner.rl_cluster.actor_trainer.model, example)
  finally:
    sera_llm.algo_core.grpo_loss_fn = grpo_loss
  return np.asarray(seen["log_p"])


@pytest.mark.slow
def test_a_policy_that_can_emit_pad_is_trained_at_its_sampling_log_probs():
  """pad (0) != EOS (2) and a decoder that puts mass on PAD: every sampled token's trained
  log-probability equals the one it was sampled with (Tunix's sampler's logprobs)."""
  model = _pad_emitting_decoder(0)
  learner = _learner(model, return_logprobs=True)
  sampled = []
  generate = learner.rl_cluster.generate
  learner.rl_cluster.generate = lambda **kwargs: sampled.append(generate(**kwargs)) or sampled[-1]
  with jax.set_mesh(tiny.mesh()):
    rollouts = learner.generate_and_score(_requests(64), TRAIN, 64)
    example = rollouts.example.replace(advantages=np.ones(64, np.float32))
    trained = _trained_log_probs(learner, example)
  (output,) = sampled
  for row, (tokens, log_p) in enumerate(zip(output.tokens, output.logprobs, strict=True)):
    np.testing.assert_allclose(trained[row, :len(tokens)], log_p, atol=2e-4,
                               err_msg=f"row {row}: {tokens}")
  assert not any(TOKENIZER.PAD in tokens for tokens in output.tokens)


def test_the_pad_emitting_decoder_puts_mass_on_pad():
  """The policy of the test above would sample PAD unmasked: the mask has work to do."""
  model = _pad_emitting_decoder(0)
  tokens = np.array([[TOKENIZER.BOS, *TOKENIZER().encode("3+4=")]])
  positions = np.arange(tokens.shape[1])[None]
  mask = np.tril(np.ones((1, tokens.shape[1], tokens.shape[1]), bool))
  logits, _ = model(tokens, positions, None, mask)
  assert jax.nn.softmax(logits[0, -1])[TOKENIZER.PAD] > 0.03


@pytest.mark.slow
@pytest.mark.parametrize("changes", [dict(top_p=0.9), dict(top_p=None), dict(top_k=5),
                                     dict(temperature=0.0)])
def test_a_sampling_law_the_loss_does_not_score_is_refused_at_construction(changes):
  with pytest.raises(ValueError, match="must sample it"):
    _learner(tiny.decoder(0), **changes)


@pytest.mark.slow
def test_pad_is_forbidden_unless_it_stops_a_rollout():
  assert _learner(tiny.decoder(0), top_k=0, temperature=0.7).forbidden == (TOKENIZER.PAD,)
  assert _learner(tiny.decoder(0), eos_tokens=[TOKENIZER.EOS, TOKENIZER.PAD]).forbidden == ()
