"""The addition task of the math experiment: problem sets, reward, warm start and sampler."""

import jax
import numpy as np
import pytest
from flax import nnx
from tunix.rl import rl_cluster as rl_cluster_lib

from sera_jax.harness.figures import math as math_figure
from sera_jax.settings.llm import arithmetic, tiny

MATH, MATH_TINY = math_figure.load_config(), math_figure.load_config(tiny=True)


def _split_sizes(config) -> dict[str, int]:
  return {"warm_start": config.warm_start_problems, "train": config.train_problems,
          "held_out": config.held_out_problems}


def test_split_draws_disjoint_sets_of_true_sums_with_every_operand_length():
  sets = arithmetic.split({"warm_start": 300, "train": 200, "held_out": 50}, seed=3)
  pairs = {}
  for name, problems in sets.items():
    assert len(problems) == {"warm_start": 300, "train": 200, "held_out": 50}[name]
    np.testing.assert_array_equal(problems.idx, np.arange(len(problems)))
    for prompt, answer in zip(problems.prompts, problems.answers, strict=True):
      assert len(prompt) == 8 and prompt.endswith("=")  # 3 places each, leading zeros
      a, b = prompt[:-1].split("+")
      assert int(answer) == int(a) + int(b) and answer == str(int(answer))
      pairs.setdefault((a, b), set()).add(name)
  assert all(len(names) == 1 for names in pairs.values())  # no pair in two sets
  lengths = {len(str(int(a))) for a, _ in pairs}
  assert lengths == {1, 2, 3}
  again = arithmetic.split({"warm_start": 300, "train": 200, "held_out": 50}, seed=3)
  np.testing.assert_array_equal(again["held_out"].prompts, sets["held_out"].prompts)
  with pytest.raises(ValueError, match="too many"):
    arithmetic.split({"train": 30}, digits=1)


@pytest.mark.parametrize(("sizes", "digits", "seed"), [
    (_split_sizes(MATH), MATH.digits, 0),
    (_split_sizes(MATH_TINY), MATH_TINY.digits, 0),
    ({"warm_start": 300, "train": 200, "held_out": 50}, 3, 3),
    ({"warm_start": 64, "held_out": 16}, 2, 0),
    ({"train": 20}, 1, 0)])
def test_split_is_disjoint_up_to_commutation(sizes, digits, seed):
  """a + b and b + a are one problem: never in two sets (the math figure's default split
  once held out 9 of 128 problems whose commuted pair was a warm-start or training one)."""
  sets = arithmetic.split(sizes, digits=digits, seed=seed)
  owner = {}
  for name, problems in sets.items():
    for prompt in problems.prompts:
      a, b = prompt[:-1].split("+")
      unordered = tuple(sorted((int(a), int(b))))
      assert owner.setdefault(unordered, name) == name, (prompt, owner[unordered], name)


def test_exact_reward_wants_the_sum_then_eos_and_nothing_else():
  got = arithmetic.exact_reward(None, ["130", " 130", "130 ", "1300", "13", ""], ["130"] * 6)
  assert got == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
  assert arithmetic.exact_reward(None, ["0", ""], np.array(["0", "0"])) == [1.0, 0.0]
  for bad in (["013"], [""], [" 13"], ["-1"]):
    with pytest.raises(ValueError, match="sums without leading zeros"):
      arithmetic.exact_reward(None, ["13"], bad)
  with pytest.raises(ValueError):  # one answer per completion
    arithmetic.exact_reward(None, ["13", "13"], ["13"])


def test_generation_must_outlast_every_answer():
  """A completion cut at max_tokens_to_generate has no EOS; it must be longer than any sum."""
  arithmetic.check_generation_length(arithmetic.max_answer_tokens(3), 3)
  with pytest.raises(ValueError, match="could equal a 4-place sum"):
    arithmetic.check_generation_length(4, 3)


@pytest.mark.slow
def test_the_sampler_draws_the_first_answer_token_from_the_policy():
  """A random decoder: the empirical law of the first completion token against softmax."""
  model = tiny.decoder(0)
  problems = arithmetic.split({"held_out": 1}, seed=0)["held_out"]
  prompt = arithmetic._prompt_tokens(problems.prompts)
  logits = arithmetic._causal_logits(model, jax.numpy.asarray(prompt))[0, -1]
  want = np.asarray(jax.nn.softmax(logits))
  tokens = arithmetic._complete(model, jax.numpy.asarray(np.repeat(prompt, 8192, axis=0)),
                                jax.random.PRNGKey(0), width=2, temperature=1.0)
  got = np.bincount(np.asarray(tokens[:, 0]), minlength=len(want)) / 8192
  np.testing.assert_allclose(got, want, atol=0.02)
  successes = arithmetic.sample_successes(model, problems, num_samples=16,
                                          key=jax.random.PRNGKey(1))
  assert successes.shape == (1,) and 0 <= successes[0] <= 16


@pytest.mark.slow
def test_a_warm_started_decoder_answers_in_tunix_rollouts_as_in_the_sampler():
  """Memorised problems: both the jitted sampler and Tunix's rollouts give their sums, so the
  warm start, the evaluation and the RL rollouts read the same token layout."""
  problems = arithmetic.split({"train": 4}, seed=1)["train"]
  model = tiny.decoder(0)
  losses = arithmetic.warm_start(model, problems, steps=300, batch_size=4, learning_rate=1e-2,
                                 seed=0)
  assert losses[-1] < 0.05 < losses[0]
  successes = arithmetic.sample_successes(model, problems, num_samples=64,
                                          key=jax.random.PRNGKey(0))
  assert (successes >= 60).all(), successes
  cluster = tiny.cluster(1)
  nnx.update(cluster.rollout.model(), nnx.state(model, nnx.Param))
  rollout = cluster.cluster_config.rollout_config
  rollout.max_tokens_to_generate, rollout.max_prompt_length = arithmetic.max_answer_tokens(3), 9
  with jax.set_mesh(tiny.mesh()):
    out = cluster.generate(list(np.repeat(problems.prompts, 16)), mode=rl_cluster_lib.Mode.TRAIN)
  rewards = arithmetic.exact_reward(None, out.text, np.repeat(problems.answers, 16))
  assert np.mean(rewards) > 0.9, out.text
