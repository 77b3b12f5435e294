"""A tiny verifiable LLM task that trains on a CPU: the tests' and benchmarks' stand-in.

Digit sums "a+b=" with a dataset index each, a character tokenizer, a random
2-layer Qwen2 decoder from Tunix's model classes, a reward with a per-prompt
difficulty, and the RLCluster (actor, reference, vanilla rollout) on one device.

The decoder cannot emit PAD or BOS (`MaskedQwen2`): Tunix's sampler and a
teacher-forced pass then see one distribution over sequences of EOS and
characters only, and a completion's text determines its tokens.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix.models.qwen2 import model as qwen2
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.rollout import base_rollout

from sera_jax.settings.llm import cluster as cluster_lib
from sera_jax.settings.llm import learner as sera_learner

CHARS = "0123456789+= "
DATASET_SIZE = 16  # prompts a+b= with a + b < 10


class CharTokenizer:
  """What Tunix's tokenizer adapter asks of a tokenizer: pad 0, bos 1, eos 2, then CHARS."""
  PAD, BOS, EOS = 0, 1, 2
  vocab_size = 3 + len(CHARS)

  def encode(self, text: str, **unused) -> list[int]:
    unknown = sorted(set(text) - set(CHARS))
    if unknown:
      raise ValueError(f"{text!r} has characters {unknown} outside the tokenizer's {CHARS!r}.")
    return [3 + CHARS.index(c) for c in text]

  def decode(self, ids, **unused) -> str:
    return "".join(CHARS[int(i) - 3] for i in ids if int(i) >= 3)

  def bos_id(self) -> int:
    return self.BOS

  def eos_id(self) -> int:
    return self.EOS

  def pad_id(self) -> int:
    return self.PAD


def dataset(num_batches: int, batch_size: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
  """Batches of prompts "a+b=" with their answer and dataset index, epoch after epoch."""
  rng = np.random.default_rng(seed)
  first = rng.integers(0, 10, DATASET_SIZE)
  second = np.array([rng.integers(0, 10 - a) for a in first])
  prompts = np.array([f"{a}+{b}=" for a, b in zip(first, second, strict=True)])
  answers = np.array([str(a + b) for a, b in zip(first, second, strict=True)])
  columns = {"prompts": prompts, "answer": answers,
             "idx": np.arange(DATASET_SIZE, dtype=np.int64)}
  return list(itertools.islice(sera_learner.epoch_batches(columns, batch_size, seed),
                               num_batches))


def slack_reward(prompts, completions, answer, idx, **unused) -> list[float]:
  """1 when the completion starts with a digit within 2 (idx % 5) of the sum: prompts differ
  in difficulty (from exact to nearly any digit), which is what SERA allocates by.

  A function of the sampled tokens only: Tunix's text is the completion up to
  its first EOS, and with PAD and BOS unemittable (`MaskedQwen2`) its first
  character is the first sampled token. A completion whose first token is EOS
  (empty text) or a non-digit gets 0.
  """
  def solved(completion: str, target: str, slack: int) -> bool:
    return completion[:1].isdigit() and abs(int(completion[0]) - int(target)) <= slack
  return [float(solved(c, a, 2 * (int(i) % 5)))
          for c, a, i in zip(completions, answer, idx, strict=True)]


def mesh() -> jax.sharding.Mesh:
  return jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


# Finite, so log-probabilities and their gradients stay finite, and far enough below any
# logit that exp(MASKED_LOGIT - max) underflows to exactly 0 in float32.
MASKED_LOGIT = -1e9
UNEMITTABLE = (CharTokenizer.PAD, CharTokenizer.BOS)


class MaskedQwen2(qwen2.Qwen2):
  """Tunix's Qwen2 whose logits of PAD and BOS are MASKED_LOGIT: a policy that never emits them.

  Tunix's sampler drops PAD and BOS from the text and masks a sampled PAD out
  of the loss and the attention, so a sequence holding one would be scored as
  another; masking them in the model itself gives the sampler, Tunix's
  log-probabilities and a teacher-forced pass the same distribution. The call
  signature is Qwen2's, so Tunix detects the same features (no
  `decode_only_last_token`, `segment_ids` accepted), and nnx.split/merge keep
  the class.
  """

  def __call__(self, input_tokens, positions, cache, attention_mask=None,
               output_hidden_states: bool = False, segment_ids=None):
    logits, cache = super().__call__(input_tokens, positions, cache, attention_mask,
                                     output_hidden_states=output_hidden_states,
                                     segment_ids=segment_ids)
    unemittable = np.isin(np.arange(logits.shape[-1]), UNEMITTABLE)
    return jnp.where(unemittable, jnp.asarray(MASKED_LOGIT, logits.dtype), logits), cache


def decoder(seed: int = 0, *, num_layers: int = 2, embed_dim: int = 32, hidden_dim: int = 64,
            num_heads: int = 2, head_dim: int = 16) -> MaskedQwen2:
  """A random Qwen2 over the characters that cannot emit PAD or BOS (`MaskedQwen2`).

  Untied embeddings (tied ones echo the last prompt token); 2 layers of width
  32 unless told otherwise.
  """
  config = qwen2.ModelConfig(num_layers=num_layers, vocab_size=CharTokenizer.vocab_size,
                             embed_dim=embed_dim, hidden_dim=hidden_dim, num_heads=num_heads,
                             head_dim=head_dim, num_kv_heads=1, rope_theta=10_000,
                             norm_eps=1e-6, use_tied_embedding=False)
  return MaskedQwen2(config, rngs=nnx.Rngs(seed))


def cluster(max_steps: int, *, checkpoint_dir: str | None = None, save_every: int = 2,
            log_dir: str | None = None, learning_rate: float = 1e-2,
            train_micro_batch_size: int | None = None) -> rl_cluster_lib.RLCluster:
  """An RLCluster of the tiny decoder (actor, reference, vanilla rollout) on one CPU device,
  for batches of BATCH_SIZE prompts (`cluster.build`'s micro-batching)."""
  rollout = base_rollout.RolloutConfig(max_tokens_to_generate=3, max_prompt_length=8,
                                       kv_cache_size=32, temperature=1.0, top_p=1.0)
  return cluster_lib.build(decoder(), CharTokenizer(), mesh(), reference=decoder(),
                           optimizer=optax.adam(learning_rate), max_steps=max_steps,
                           rollout_config=rollout, checkpoint_dir=checkpoint_dir,
                           save_every=save_every, log_dir=log_dir, batch_size=BATCH_SIZE,
                           train_micro_batch_size=train_micro_batch_size)


BATCH_SIZE, BASELINE_N, N_MAX = 4, 4, 16  # M prompts a step, N0, n_max: B = 16 rollouts


def train_sera(num_steps: int, checkpoint_dir: str | None = None):
  """Trains the tiny decoder with `SeraLearner` to `num_steps` (resuming checkpoint_dir).

  Returns:
    The learner (its `historical`, `batches_seen` and `last_counts`).
  """
  config = sera_learner.SeraConfig(num_generations=BASELINE_N, n_min=2, n_max=N_MAX,
                                   dataset_size=DATASET_SIZE)
  learner = sera_learner.SeraLearner(cluster(num_steps, checkpoint_dir=checkpoint_dir), config,
                                     slack_reward)
  with jax.set_mesh(mesh()):
    learner.train(dataset(num_steps, BATCH_SIZE))
  return learner


def main(argv: list[str] | None = None) -> None:
  import argparse
  parser = argparse.ArgumentParser(
      prog="python -m sera_jax.settings.llm.tiny",
      description="Train the tiny digit-sum decoder with SERA inside Tunix on this machine.")
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--checkpoint_dir", default=None,
                      help="Tunix checkpoints and the SERA estimator (resumed when present)")
  args = parser.parse_args(argv)
  learner = train_sera(args.steps, args.checkpoint_dir)
  last = "none trained now" if learner.last_counts is None else learner.last_counts.tolist()
  print(f"{learner.batches_seen} batches allocated; the last one's counts: {last}")


if __name__ == "__main__":
  main()
