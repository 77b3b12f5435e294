"""Multi-digit addition as verifiable math reasoning on a CPU.

A problem is "a+b=" with both operands written with `digits` places
(leading zeros), a = 7 becomes "007"; the answer is the sum without leading
zeros followed by EOS, and the reward is 1 exactly when the completion is the
sum. Each operand's length is drawn uniformly from 1..digits before its value,
so a batch mixes one-digit sums, which a briefly warm-started decoder nearly
always solves, with three-digit sums and carries, which it solves a few times
in a thousand: the spread of p over orders of magnitude that SERA allocates by.

* `problems`: a fixed set with dataset indices; `split` draws disjoint
  warm-start, training and held-out sets.
* `exact_reward`: the Tunix reward function.
* `warm_start`: supervised steps on (prompt, answer) pairs, the loss on the
  answer's tokens and EOS only.
* `sample_successes`: n samples of every held-out problem from the policy,
  jitted (a causal forward pass over a fixed-length buffer per token), and the
  successes per problem, for `sera_jax.common.evaluation.pass_at_k`.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sera_jax.settings.llm import tiny

TOKENIZER = tiny.CharTokenizer()


class Problems(NamedTuple):
  """Addition problems: prompts "007+123=", answers "130", dataset indices."""
  prompts: np.ndarray
  answers: np.ndarray
  idx: np.ndarray

  def __len__(self) -> int:
    return len(self.prompts)

  @property
  def digits(self) -> int:
    """The places every operand is written with."""
    return len(self.prompts[0].split("+")[0])

  def columns(self) -> dict[str, np.ndarray]:
    """The batch keys Tunix passes to the reward: prompts, answer, idx."""
    return {"prompts": self.prompts, "answer": self.answers, "idx": self.idx}


def _operands(rng: np.random.Generator, count: int, digits: int) -> np.ndarray:
  """`count` operands whose number of digits is uniform in 1..digits."""
  lengths = rng.integers(1, digits + 1, count)
  low = np.where(lengths == 1, 0, 10 ** (lengths - 1))
  return rng.integers(low, 10**lengths)


def split(sizes: dict[str, int], *, digits: int = 3, seed: int = 0) -> dict[str, Problems]:
  """Disjoint problem sets of the given sizes (e.g. warm_start, train, held_out).

  No (a, b) pair occurs in two sets, so held-out scores measure problems the
  policy never saw. Each set's `idx` runs over 0..size - 1.
  """
  rng = np.random.default_rng(seed)
  total = sum(sizes.values())
  if total > 100**digits // 4:
    raise ValueError(f"{total} distinct problems are too many for {digits}-digit operands.")
  pairs: dict[tuple[int, int], None] = {}  # insertion-ordered, so the split is reproducible
  while len(pairs) < total:
    first, second = _operands(rng, total, digits), _operands(rng, total, digits)
    pairs.update(dict.fromkeys(zip(first.tolist(), second.tolist(), strict=True)))
  ordered = list(pairs)[:total]
  sets, start = {}, 0
  for name, size in sizes.items():
    chosen = ordered[start:start + size]
    start += size
    sets[name] = Problems(
        prompts=np.array([f"{a:0{digits}d}+{b:0{digits}d}=" for a, b in chosen]),
        answers=np.array([str(a + b) for a, b in chosen]),
        idx=np.arange(size, dtype=np.int64))
  return sets


def max_answer_tokens(digits: int) -> int:
  """The tokens of the longest completion: digits + 1 places of the sum, then EOS."""
  return digits + 2


def exact_reward(prompts, completions, answer, **unused) -> list[float]:
  """1 when the completion is exactly the sum (Tunix strips the EOS), else 0."""
  return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]


def _prompt_tokens(prompts: np.ndarray) -> np.ndarray:
  """[Q, 1 + len] BOS then the prompt's characters, as Tunix's sampler tokenizes them."""
  return np.array([[TOKENIZER.bos_id(), *TOKENIZER.encode(p)] for p in prompts], np.int32)


def _causal_logits(model: nnx.Module, tokens: jax.Array) -> jax.Array:
  """Logits of every position of fixed-length `tokens`, each seeing only its past."""
  length = tokens.shape[1]
  positions = jnp.broadcast_to(jnp.arange(length), tokens.shape)
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)),
                          (tokens.shape[0], length, length))
  logits, _ = model(tokens, positions, None, mask)
  return logits


def warm_start(model: nnx.Module, problems: Problems, *, steps: int, batch_size: int,
               learning_rate: float, seed: int) -> list[float]:
  """Trains `model` in place on prompt -> answer + EOS by teacher forcing (Adam).

  Returns:
    The loss of every step (mean cross-entropy per answer token).
  """
  width = max_answer_tokens(problems.digits)
  prompts = _prompt_tokens(problems.prompts)
  targets = np.full((len(problems), width), TOKENIZER.pad_id(), np.int32)
  for row, answer in enumerate(problems.answers):
    encoded = [*TOKENIZER.encode(answer), TOKENIZER.eos_id()]
    targets[row, :len(encoded)] = encoded
  sequences = jnp.asarray(np.concatenate([prompts, targets], axis=1))
  optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)
  rng = np.random.default_rng(seed)
  return [float(_supervised_step(model, optimizer,
                                 sequences[rng.integers(0, len(problems), batch_size)],
                                 prompt_length=prompts.shape[1]))
          for _ in range(steps)]


@functools.partial(nnx.jit, static_argnames="prompt_length")
def _supervised_step(model, optimizer, batch, *, prompt_length: int):
  def loss_fn(model):
    logits = _causal_logits(model, batch[:, :-1])[:, prompt_length - 1:]
    answer = batch[:, prompt_length:]
    weights = (answer != TOKENIZER.pad_id()).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, answer)
    return jnp.sum(losses * weights) / jnp.sum(weights)
  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def sample_successes(model: nnx.Module, problems: Problems, *, num_samples: int,
                     key: jax.Array, temperature: float = 1.0, chunk: int = 8192) -> np.ndarray:
  """Successes among `num_samples` completions of every problem (int [Q]).

  Completions are sampled token by token at `temperature` (as the rollouts
  are), `chunk` sequences at a time, and scored by `exact_reward`.
  """
  width = max_answer_tokens(problems.digits)
  prompts = np.repeat(_prompt_tokens(problems.prompts), num_samples, axis=0)
  answers = np.repeat(problems.answers, num_samples)
  completions = []
  for first in range(0, len(prompts), chunk):
    tokens = _complete(model, jnp.asarray(prompts[first:first + chunk]),
                       jax.random.fold_in(key, first), width=width, temperature=temperature)
    completions += [_until_eos(row) for row in np.asarray(tokens)]
  correct = np.array(exact_reward(None, completions, answers), np.float64)
  return correct.reshape(len(problems), num_samples).sum(axis=1).astype(np.int64)


@functools.partial(nnx.jit, static_argnames=("width", "temperature"))
def _complete(model, prompts, key, *, width: int, temperature: float):
  """`width` sampled tokens after each prompt (a causal pass over the whole buffer each)."""
  start = prompts.shape[1]
  buffer = jnp.concatenate(
      [prompts, jnp.full((prompts.shape[0], width), TOKENIZER.pad_id(), jnp.int32)], axis=1)

  def next_token(position, buffer):
    logits = _causal_logits(model, buffer)[:, position - 1] / temperature
    token = jax.random.categorical(jax.random.fold_in(key, position), logits)
    return buffer.at[:, position].set(token.astype(jnp.int32))

  return jax.lax.fori_loop(start, start + width, next_token, buffer)[:, start:]


def _until_eos(tokens: np.ndarray) -> str:
  """The text of a completion up to its first EOS, as Tunix's sampler returns it."""
  ends = np.flatnonzero(tokens == TOKENIZER.eos_id())
  return TOKENIZER.decode(tokens[:ends[0]] if ends.size else tokens)
