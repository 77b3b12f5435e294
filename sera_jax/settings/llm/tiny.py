"""A tiny verifiable LLM task that trains on a CPU: the tests' and benchmarks' stand-in.

Digit sums "a+b=" with a dataset index each, a character tokenizer, a random
2-layer Qwen2 decoder from Tunix's model classes, a reward with a per-prompt
difficulty, and the RLCluster (actor, reference, vanilla rollout) on one device or
on an ("fsdp", "tp") mesh of several.

The decoder cannot emit PAD or BOS (`MaskedQwen2`): Tunix's sampler and a
teacher-forced pass then see one distribution over sequences of EOS and
characters only, and a completion's text determines its tokens.
"""

import argparse
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


def mesh(shape: tuple[int, int] = (1, 1)) -> jax.sharding.Mesh:
  """The ("fsdp", "tp") mesh of `shape` over the first fsdp * tp devices (one by default)."""
  return cluster_lib.make_mesh(shape)


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
            num_heads: int = 2, num_kv_heads: int = 1, head_dim: int = 16) -> MaskedQwen2:
  """A random Qwen2 over the characters that cannot emit PAD or BOS (`MaskedQwen2`).

  Untied embeddings (tied ones echo the last prompt token); 2 layers of width
  32 unless told otherwise. Its parameters carry Tunix's default Qwen2 sharding
  annotations (embedding and MLP widths on "fsdp", heads and the vocabulary on
  "tp"), so on a mesh with tp > 1 the head counts must be multiples of tp
  (`heads_for`).
  """
  config = qwen2.ModelConfig(num_layers=num_layers, vocab_size=CharTokenizer.vocab_size,
                             embed_dim=embed_dim, hidden_dim=hidden_dim, num_heads=num_heads,
                             head_dim=head_dim, num_kv_heads=num_kv_heads, rope_theta=10_000,
                             norm_eps=1e-6, use_tied_embedding=False)
  return MaskedQwen2(config, rngs=nnx.Rngs(seed))


def rollout_config() -> base_rollout.RolloutConfig:
  """Tunix's rollouts of the digit sums: 3 tokens at temperature 1 after prompts of up to 8."""
  return base_rollout.RolloutConfig(max_tokens_to_generate=3, max_prompt_length=8,
                                    kv_cache_size=32, temperature=1.0, top_p=1.0)


def heads_for(tp: int) -> dict[str, int]:
  """The decoder's head counts on a mesh with `tp` tensor-parallel shards: 2 query heads
  and 1 key-value head a shard (tp = 1: `decoder`'s defaults)."""
  return {"num_heads": 2 * tp, "num_kv_heads": tp}


def cluster(max_steps: int, *, checkpoint_dir: str | None = None, save_every: int = 2,
            log_dir: str | None = None, learning_rate: float = 1e-2,
            train_micro_batch_size: int | None = None,
            actor_mesh: jax.sharding.Mesh | None = None,
            rollout_mesh: jax.sharding.Mesh | None = None,
            num_heads: int = 2, num_kv_heads: int = 1) -> rl_cluster_lib.RLCluster:
  """An RLCluster of the tiny decoder (actor, reference, vanilla rollout), for batches of
  BATCH_SIZE prompts (`cluster.build`'s micro-batching).

  The actor and the reference live on `actor_mesh` (default one CPU device), the
  rollout on `rollout_mesh` (default the actor's); the decoder has `num_heads`
  and `num_kv_heads` (`heads_for` the meshes' tp).
  """
  heads = {"num_heads": num_heads, "num_kv_heads": num_kv_heads}
  return cluster_lib.build(decoder(**heads), CharTokenizer(),
                           mesh() if actor_mesh is None else actor_mesh,
                           reference=decoder(**heads), optimizer=optax.adam(learning_rate),
                           max_steps=max_steps, rollout_config=rollout_config(),
                           checkpoint_dir=checkpoint_dir, save_every=save_every,
                           log_dir=log_dir, batch_size=BATCH_SIZE,
                           train_micro_batch_size=train_micro_batch_size,
                           rollout_mesh=rollout_mesh)


BATCH_SIZE, BASELINE_N, N_MAX = 4, 4, 16  # M prompts a step, N0, n_max: B = 16 rollouts


def train_sera(num_steps: int, checkpoint_dir: str | None = None,
               mesh_shape: tuple[int, int] = (1, 1)):
  """Trains the tiny decoder with `SeraLearner` to `num_steps` (resuming checkpoint_dir)
  on an (fsdp, tp) = `mesh_shape` mesh, the decoder's heads `heads_for` its tp.

  Returns:
    The learner (its `historical`, `batches_seen` and `last_counts`).
  """
  config = sera_learner.SeraConfig(num_generations=BASELINE_N, n_min=2, n_max=N_MAX,
                                   dataset_size=DATASET_SIZE)
  actor_mesh = mesh(mesh_shape)
  learner = sera_learner.SeraLearner(
      cluster(num_steps, checkpoint_dir=checkpoint_dir, actor_mesh=actor_mesh,
              **heads_for(mesh_shape[1])),
      config, slack_reward)
  with jax.set_mesh(actor_mesh):
    learner.train(dataset(num_steps, BATCH_SIZE))
  return learner


def _mesh_shape(text: str) -> tuple[int, int]:
  """"FSDP,TP" as two positive ints, for argparse."""
  sizes = text.split(",")
  if len(sizes) != 2 or not all(size.isdecimal() and int(size) >= 1 for size in sizes):
    raise argparse.ArgumentTypeError(f"expected FSDP,TP, two positive integers; got {text!r}")
  return int(sizes[0]), int(sizes[1])


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
      prog="python -m sera_jax.settings.llm.tiny",
      description="Train the tiny digit-sum decoder with SERA inside Tunix on this machine.")
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--checkpoint_dir", default=None,
                      help="Tunix checkpoints and the SERA estimator (resumed when present)")
  parser.add_argument("--mesh", type=_mesh_shape, default=(1, 1), metavar="FSDP,TP",
                      help="the (fsdp, tp) mesh over the first FSDP * TP devices (default "
                           "1,1); fake CPU devices: XLA_FLAGS="
                           "--xla_force_host_platform_device_count=8")
  args = parser.parse_args(argv)
  learner = train_sera(args.steps, args.checkpoint_dir, args.mesh)
  last = "none trained now" if learner.last_counts is None else learner.last_counts.tolist()
  print(f"{learner.batches_seen} batches allocated; the last one's counts: {last}")


if __name__ == "__main__":
  main()
