"""Multi-digit addition as verifiable math reasoning on a CPU.

A problem is "a+b=" with both operands written with `digits` places
(leading zeros), a = 7 becomes "007"; the answer is the sum without leading
zeros followed by EOS, and the reward is 1 exactly when the completion is the
sum and then EOS. Each operand's length is drawn uniformly from 1..digits
before its value, so a batch mixes one-digit sums, which a briefly
warm-started decoder nearly always solves, with three-digit sums and carries,
which it solves a few times in a thousand: the spread of p over orders of
magnitude that SERA allocates by.

* `problems`: a fixed set with dataset indices; `split` draws warm-start,
  training and held-out sets disjoint up to commutation.
* `exact_reward`: the Tunix reward function, 1 for exactly the sequences
  counted in p = pi(answer + EOS | prompt).
* `exact_log_p`, `batch_log_p`: log p of every problem from one
  teacher-forced pass, differentiable in the model's parameters (the oracle
  of the exact likelihood gradient).
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
from tunix.rl.rollout import base_rollout

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
  """Problem sets of the given sizes (e.g. warm_start, train, held_out), disjoint up to
  commutation.

  No (a, b) occurs twice, nor with its commuted pair (b, a), in any set or
  across sets: a + b = b + a, so a held-out "b+a=" would be a problem the
  policy saw. Held-out scores therefore measure unseen problems. Each set's
  `idx` runs over 0..size - 1.
  """
  if digits < 1 or any(size < 0 for size in sizes.values()):
    raise ValueError(f"digits ({digits}) must be >= 1 and the sizes {sizes} >= 0.")
  rng = np.random.default_rng(seed)
  total = sum(sizes.values())
  if total > 100**digits // 4:
    raise ValueError(f"{total} distinct problems are too many for {digits}-digit operands.")
  pairs: dict[tuple[int, int], None] = {}  # insertion-ordered, so the split is reproducible
  unordered: set[tuple[int, int]] = set()
  while len(pairs) < total:
    first, second = _operands(rng, total, digits), _operands(rng, total, digits)
    for pair in zip(first.tolist(), second.tolist(), strict=True):
      if (key := (min(pair), max(pair))) not in unordered:
        unordered.add(key)
        pairs[pair] = None
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


def rollout_config(digits: int) -> base_rollout.RolloutConfig:
  """Tunix's rollouts of `digits`-place problems at temperature 1: room for the longest
  answer and its EOS (so `exact_reward` is exact), the prompt (BOS, a, "+", b, "=")."""
  return base_rollout.RolloutConfig(
      max_tokens_to_generate=max_answer_tokens(digits), max_prompt_length=2 * digits + 3,
      kv_cache_size=4 * digits + 8, temperature=1.0, top_p=1.0)


def exact_reward(prompts, completions, answer, **unused) -> list[float]:
  """1 exactly when the completion's tokens are the answer's tokens and then EOS, else 0.

  Tunix's sampler returns the text up to, not including, the first EOS, and
  the text of a completion cut at max_tokens_to_generate, which has no EOS.
  Comparing texts is exact because:
  * the decoder cannot emit PAD or BOS (`tiny.MaskedQwen2`), so every sampled
    token before the first EOS is one character and the text determines the
    tokens ("130" is only 1, 3, 0; " 130" is another sequence, and gets 0);
  * a truncated completion has max_tokens_to_generate characters, more than
    any answer has when the rollouts generate at least
    `max_answer_tokens(digits)` = digits + 2 tokens (a sum has at most
    digits + 1 places): it never equals the answer. `check_generation_length`
    guards that setting; each answer is checked to be a sum's digits.

  So the reward is 1 for exactly the sequences counted in
  p = pi(answer + EOS | prompt) (`exact_log_p`).

  Args:
    prompts: unused (Tunix passes them).
    completions: Tunix's completion texts.
    answer: the sums, decimal without leading zeros, one per completion.

  Raises:
    ValueError: an answer that is not a sum's decimal digits.
  """
  answers = [str(a) for a in answer]
  bad = [a for a in answers if not (a.isdecimal() and a.isascii() and a == str(int(a)))]
  if bad:
    raise ValueError(f"answers must be sums without leading zeros, got {bad[:3]}.")
  return [float(str(c) == a) for c, a in zip(completions, answers, strict=True)]


def check_generation_length(max_tokens_to_generate: int, digits: int) -> None:
  """Raises ValueError unless rollouts of `max_tokens_to_generate` tokens keep
  `exact_reward` exact for `digits`-place operands: more tokens than any answer has."""
  if max_tokens_to_generate < max_answer_tokens(digits):
    raise ValueError(
        f"max_tokens_to_generate ({max_tokens_to_generate}) must be >= "
        f"max_answer_tokens({digits}) = {max_answer_tokens(digits)}: a completion cut at "
        f"{max_tokens_to_generate} tokens could equal a {digits + 1}-place sum without its EOS.")


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


def _answer_tokens(answers) -> tuple[np.ndarray, np.ndarray]:
  """[Q, W] each answer's characters then EOS, right-padded with PAD, and the bool mask
  of those tokens; W = the longest answer + 1."""
  encoded = [[*TOKENIZER.encode(str(a)), TOKENIZER.eos_id()] for a in answers]
  width = max(len(tokens) for tokens in encoded)
  tokens = np.full((len(encoded), width), TOKENIZER.pad_id(), np.int32)
  mask = np.zeros((len(encoded), width), bool)
  for row, answer in enumerate(encoded):
    tokens[row, :len(answer)], mask[row, :len(answer)] = answer, True
  return tokens, mask


def exact_log_p(model: nnx.Module, prompts, answers) -> jax.Array:
  """log p_q = log pi(answer tokens + EOS | BOS + prompt tokens) of every problem (float32 [Q]).

  One teacher-forced causal pass over BOS, prompt, answer and EOS, the sum of
  the log-softmax of the answer's tokens and EOS (PAD after shorter answers is
  masked). The sequences are laid out as Tunix's sampler feeds them (BOS, the
  prompt's characters, no padding inside), and `exact_reward` is 1 for exactly
  these sequences, so p_q is the probability that a rollout is rewarded.
  Differentiable in the model's nnx.Param (nnx.grad of the mean of it is the
  exact gradient of (1/Q) sum_q log p_q) and jittable: the strings are
  tokenized on the host, so jit a function that closes over them.

  Args:
    model: a decoder over `TOKENIZER`'s ids (`tiny.decoder`).
    prompts: Q prompt strings of one length ("007+123=").
    answers: Q answer strings, any lengths ("130"; "" is the probability of EOS first).

  Raises:
    ValueError: no prompts, a count mismatch, prompts of different lengths or a
      character the tokenizer lacks.
  """
  prompts, answers = [str(p) for p in prompts], [str(a) for a in answers]
  if not prompts or len(prompts) != len(answers):
    raise ValueError(f"need one answer per prompt and at least one prompt, got "
                     f"{len(prompts)} prompts and {len(answers)} answers.")
  if len({len(p) for p in prompts}) != 1:
    raise ValueError("the prompts of one call must have one length (the same digits), got "
                     f"lengths {sorted({len(p) for p in prompts})}.")
  prompt_tokens = _prompt_tokens(np.asarray(prompts))
  answer_tokens, answer_mask = _answer_tokens(answers)
  return _teacher_forced_log_p(model, jnp.asarray(prompt_tokens), jnp.asarray(answer_tokens),
                               jnp.asarray(answer_mask))


def batch_log_p(model: nnx.Module, batch: dict) -> jax.Array:
  """`exact_log_p` of a Tunix batch (its "prompts" and "answer" columns): float32 [M].

  The oracle `SeraConfig(log_p_source=arithmetic.batch_log_p)` calls.
  """
  missing = [key for key in ("prompts", "answer") if key not in batch]
  if missing:
    raise KeyError(f"the batch lacks {missing}; it has {sorted(batch)}.")
  return exact_log_p(model, batch["prompts"], batch["answer"])


@nnx.jit
def _teacher_forced_log_p(model, prompt_tokens, answer_tokens, answer_mask):
  """Per row, the sum over the answer's tokens and EOS (answer_mask) of
  log pi(token | every token before it)."""
  sequences = jnp.concatenate([prompt_tokens, answer_tokens], axis=1)
  # The logits at position t predict token t + 1: the answer's start at the prompt's last.
  logits = _causal_logits(model, sequences[:, :-1])[:, prompt_tokens.shape[1] - 1:]
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  chosen = jnp.take_along_axis(log_probs, answer_tokens[..., None], axis=-1)[..., 0]
  return jnp.sum(jnp.where(answer_mask, chosen, 0.0), axis=1)


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
