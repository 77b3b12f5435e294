"""The tiny and arithmetic tasks are exact: a policy without PAD or BOS, rewards that are 1 for
exactly the sequences counted in p, and a teacher-forced p that Tunix's rollouts sample at."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tunix.models.qwen2 import model as qwen2
from tunix.rl import rl_cluster as rl_cluster_lib

from sera_jax.settings.llm import arithmetic, tiny

TOKENIZER = tiny.CharTokenizer
UNEMITTABLE = [TOKENIZER.PAD, TOKENIZER.BOS]
SAMPLES = 4096


@functools.partial(nnx.jit, static_argnames="unmasked")
def _logits(model: nnx.Module, tokens: jax.Array, *, unmasked: bool = False) -> jax.Array:
  """A causal pass over unpadded `tokens`; `unmasked`: Qwen2's own logits, PAD and BOS kept."""
  length = tokens.shape[1]
  positions = jnp.broadcast_to(jnp.arange(length), tokens.shape)
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)),
                          (tokens.shape[0], length, length))
  call = qwen2.Qwen2.__call__ if unmasked else type(model).__call__
  return call(model, tokens, positions, None, mask)[0]


def _rollout_cluster(model: nnx.Module, *, digits: int, seed: int) -> rl_cluster_lib.RLCluster:
  """tiny.cluster whose actor holds `model`'s weights, synced to the rollout as the learner
  syncs them, generating the longest answer's tokens with a seed of its own."""
  cluster = tiny.cluster(1)
  actor = cluster.actor_trainer.model
  # On the actor's own shardings, as after a training step, so Tunix's sync can reshard them.
  nnx.update(actor, jax.tree.map(lambda new, old: jax.device_put(new, old.sharding),
                                 nnx.state(model, nnx.Param), nnx.state(actor, nnx.Param)))
  cluster.sync_weights()
  rollout = cluster.cluster_config.rollout_config
  rollout.max_tokens_to_generate = arithmetic.max_answer_tokens(digits)
  rollout.max_prompt_length = 2 * digits + 3  # BOS, a, "+", b, "="
  arithmetic.check_generation_length(rollout.max_tokens_to_generate, digits)
  # Without a seed Tunix draws every generate call with PRNGKey(0).
  rollout.seed = jax.random.PRNGKey(seed)
  return cluster


def _assert_only_characters(rollout: object) -> None:
  """No PAD or BOS sampled, no EOS kept: the text is the tokens, one character each."""
  for tokens, text in zip(rollout.tokens, rollout.text, strict=True):
    tokens = np.asarray(tokens)
    assert not np.isin(tokens, [*UNEMITTABLE, TOKENIZER.EOS]).any(), tokens
    assert TOKENIZER().encode(text) == tokens.tolist()


def _z_scores(p: np.ndarray, freq: np.ndarray, samples: int) -> np.ndarray:
  return (freq - p) / np.sqrt(p * (1 - p) / samples)


def test_the_decoder_cannot_emit_pad_or_bos_and_keeps_its_class():
  model = tiny.decoder(0)
  tokens = jnp.asarray(arithmetic._prompt_tokens(np.array(["3+4=", "9+0="])))
  logits = _logits(model, tokens)
  probs = jax.nn.softmax(logits)
  assert (probs[..., UNEMITTABLE] == 0).all()  # exp underflows to exactly 0
  assert np.isfinite(jax.nn.log_softmax(logits)).all()
  # The same weights without the mask put mass on them: the mask has something to remove.
  raw = _logits(model, tokens, unmasked=True)
  assert jax.nn.softmax(raw)[..., UNEMITTABLE].sum(-1).min() > 0.05
  emittable = np.setdiff1d(np.arange(TOKENIZER.vocab_size), UNEMITTABLE)
  np.testing.assert_array_equal(logits[..., emittable], raw[..., emittable])
  graphdef, state = nnx.split(model)
  assert type(nnx.merge(graphdef, state)) is tiny.MaskedQwen2


def test_slack_reward_reads_the_first_sampled_token():
  """Empty text is a first token EOS; a first non-digit (space, + or =) scores 0 too."""
  completions = ["", "5", " 5", "+5", "=5", "50", "9", "9"]
  got = tiny.slack_reward(None, completions, ["5"] * 8, [0, 0, 0, 0, 0, 0, 0, 2])
  assert got == [0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]


def test_exact_log_p_is_the_product_of_next_token_probabilities():
  """Answers of lengths 0 to 3 in one call; each checked token by token on growing prefixes."""
  model = tiny.decoder(1)
  prompts = ["07+05=", "99+99=", "00+00=", "42+08=", "13+13="]
  answers = ["12", "198", "0", "5", ""]
  got = np.asarray(arithmetic.exact_log_p(model, prompts, answers))
  assert got.dtype == np.float32 and got.shape == (5,)
  want = []
  for prompt, answer in zip(prompts, answers, strict=True):
    tokens, log_p = [TOKENIZER.BOS, *TOKENIZER().encode(prompt)], 0.0
    for target in [*TOKENIZER().encode(answer), TOKENIZER.EOS]:
      logits = _logits(model, jnp.asarray([tokens]))[0, -1]
      log_p += np.log(np.asarray(jax.nn.softmax(logits), np.float64)[target])
      tokens.append(target)
    want.append(log_p)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  batch = {"prompts": np.array(prompts), "answer": np.array(answers), "idx": np.arange(5)}
  np.testing.assert_array_equal(arithmetic.batch_log_p(model, batch), got)


@pytest.mark.slow
def test_exact_log_p_is_jittable_and_its_gradient_is_the_finite_difference():
  model = tiny.decoder(2)
  prompts, answers = ["07+05=", "99+99=", "00+00="], ["12", "198", "0"]

  def objective(model):
    return jnp.mean(arithmetic.exact_log_p(model, prompts, answers))

  np.testing.assert_allclose(nnx.jit(objective)(model), objective(model), rtol=1e-6)
  grads = nnx.grad(objective)(model)
  leaves = jax.tree.leaves(grads)
  assert all(np.isfinite(leaf).all() for leaf in leaves)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  flat, treedef = jax.tree.flatten(params)
  rng = np.random.default_rng(0)  # numpy, not one compiled jax.random op per leaf shape
  direction = [rng.standard_normal(leaf.shape) for leaf in flat]
  norm = np.sqrt(sum(np.sum(d**2) for d in direction))
  direction = [(d / norm).astype(np.float32) for d in direction]

  def along(step: float) -> float:
    moved = [jnp.asarray(np.asarray(p) + step * d)
             for p, d in zip(flat, direction, strict=True)]
    return float(objective(nnx.merge(graphdef, jax.tree.unflatten(treedef, moved), rest)))

  analytic = sum(np.vdot(np.asarray(g, np.float64), d)
                 for g, d in zip(leaves, direction, strict=True))
  # Central differences: float32 rounding of the mean (about 1e-6) over the step, 2e-5, and
  # the step's own O(step^2) error stay well inside rtol * 0.05.
  step = 3e-2
  finite_difference = (along(step) - along(-step)) / (2 * step)
  assert abs(analytic) > 0.01  # a direction the objective moves along
  np.testing.assert_allclose(finite_difference, analytic, rtol=2e-3)


def test_exact_log_p_rejects_bad_input():
  model = tiny.decoder(0)
  with pytest.raises(ValueError, match="one answer per prompt"):
    arithmetic.exact_log_p(model, ["1+2="], ["3", "4"])
  with pytest.raises(ValueError, match="one answer per prompt"):
    arithmetic.exact_log_p(model, [], [])
  with pytest.raises(ValueError, match="one length"):
    arithmetic.exact_log_p(model, ["1+2=", "01+02="], ["3", "3"])
  with pytest.raises(ValueError, match="outside the tokenizer"):
    arithmetic.exact_log_p(model, ["1+2="], ["x"])
  with pytest.raises(KeyError, match="answer"):
    arithmetic.batch_log_p(model, {"prompts": np.array(["1+2="])})


@pytest.mark.slow
def test_tunix_rollouts_of_the_synced_decoder_hold_no_pad_or_bos_and_sample_p():
  """A random decoder (whose PAD and BOS would carry mass unmasked) synced into Tunix's
  rollout: no sampled PAD or BOS, and the completions of at most one token (each then EOS)
  are sampled at their teacher-forced p."""
  model, prompt = tiny.decoder(3), "07+05="
  cluster = _rollout_cluster(model, digits=2, seed=11)
  assert type(cluster.rollout.model()) is tiny.MaskedQwen2
  with jax.set_mesh(tiny.mesh()):
    out = cluster.generate([prompt] * SAMPLES, mode=rl_cluster_lib.Mode.TRAIN)
  _assert_only_characters(out)
  short = ["", *tiny.CHARS]
  p = np.exp(np.asarray(arithmetic.exact_log_p(model, [prompt] * len(short), short), np.float64))
  freq = np.array([np.mean([text == answer for text in out.text]) for answer in short])
  assert 0.05 < p.max() < 0.9
  assert (np.abs(_z_scores(p, freq, SAMPLES)) < 4).all(), (p, freq)


@pytest.mark.slow
def test_teacher_forced_p_is_tunix_sampling_frequency():
  """The issue's check: on >= 3 prompts of a briefly warm-started decoder, p within 4 standard
  errors of the frequency of exact_reward among 4096 of Tunix's rollouts each."""
  digits = 2
  problems = arithmetic.split({"warm_start": 64}, digits=digits, seed=0)["warm_start"]
  model = tiny.decoder(0)
  arithmetic.warm_start(model, problems, steps=60, batch_size=32, learning_rate=1e-2, seed=0)
  p = np.exp(np.asarray(arithmetic.exact_log_p(model, problems.prompts, problems.answers),
                        np.float64))
  # Chosen by p alone (not by the samples), where a wrong p would show: 4 SE <= 0.03.
  chosen = np.flatnonzero((p > 0.05) & (p < 0.9))[:4]
  assert len(chosen) >= 3, p
  cluster = _rollout_cluster(model, digits=digits, seed=7)
  with jax.set_mesh(tiny.mesh()):
    out = cluster.generate(list(np.repeat(problems.prompts[chosen], SAMPLES)),
                           mode=rl_cluster_lib.Mode.TRAIN)
  _assert_only_characters(out)
  rewards = arithmetic.exact_reward(None, out.text, np.repeat(problems.answers[chosen], SAMPLES))
  freq = np.reshape(rewards, (len(chosen), SAMPLES)).mean(axis=1)
  z = _z_scores(p[chosen], freq, SAMPLES)
  for row, q in enumerate(chosen):
    print(f"{problems.prompts[q]}{problems.answers[q]}: p {p[q]:.4f} freq {freq[row]:.4f} "
          f"z {z[row]:+.2f}")
  assert (np.abs(z) < 4).all(), (p[chosen], freq)
