"""Everything `SeraLearner` needs from Tunix beyond its public API, written for google-tunix 0.1.7.

The learner (`learner.py`) otherwise uses only Tunix's public API: `RLCluster.generate`,
`get_ref_per_token_logps`, `get_rollout_config` and `buffer_metrics`, the function registry,
`tunix.rl.utils` and `TrainExample`. What reaches past it is here, each with the Tunix file and
function it works around, so that a new Tunix is checked in one place. Paths are under tunix/.

Learner hooks overridden (`WholeBatchLearner`; no public hook hands a learner a step's batch):

* `RLLearner._process_accumulated_batches` (rl/rl_learner.py; `RLLearner._prepare_data` calls it
  with a step's train micro-batches, each prompt repeated `_num_generations()` times, and queues
  the TrainExamples it returns in order, one a train micro-batch): SERA allocates here, over the
  whole batch, and repeats each prompt by its own count.
* `RLLearner._num_generations` (-> 1) and `_compute_trajectory_ids` (GRPOLearner's, in
  rl/grpo/grpo_learner.py, assume groups of num_generations).
* `RLLearner._run_global_step` (rl/rl_learner.py; `RLLearner.train` calls it with the batch
  sizes it resolved): the sizes are checked before the first generation.
* `GRPOLearner._generate_and_compute_advantage` (rl/grpo/grpo_learner.py) is never called: the
  learner generates and scores through the public API (`SeraLearner.generate_and_score`) and
  keeps that method's TrainExample fields and its rewards/score/* and completions/*_length
  metrics. Missing seam: a hook between generation and padding (to give each stopped rollout
  the stop token it sampled back and keep its length) and a way to return rewards and
  completions with the example.
* the actor trainer's loss (`score_policy`): `GRPOLearner.__init__` sets it (`with_loss_fn`)
  to a function (model, train_example, algo_config) of the registered policy loss; it is
  wrapped to score the `PolicyLogits` of the model, the law the sampler samples (the tokens
  it may not emit masked).

Private members read (no public accessor in 0.1.7):

* `RLLearner._rollout_micro_batch_size`, `_compute_logps_micro_batch_size` (set by
  `RLLearner.train`): `WholeBatchLearner.micro_batch_sizes`;
* `RLLearner._compute_rewards` (rl/rl_learner.py): `WholeBatchLearner.compute_rewards`;
* `PeftTrainer._has_aux` (sft/peft_trainer.py, set by `with_loss_fn`): `training_loss`,
  `score_policy`;
* `VanillaRollout._sampler` (rl/rollout/vanilla_rollout.py): `sample_policy`;
* `PeftTrainer._restored_custom_metadata` (sft/peft_trainer.py `PeftTrainer.__init__`; rl/trainer.py
  `Trainer.restored_global_step` reads only its "global_step"): `restored_metadata`;
* `CheckpointManager._checkpoint_manager` (sft/checkpoint_manager.py, the Orbax manager, None
  without a checkpoint directory): `save_metadata_with_checkpoints`.

Patched, on the instances of one cluster:

* `rollout.generate` (`seed_each_generation`): rl/rl_cluster.py `RLCluster.generate` passes one
  RolloutConfig, so one seed, to every chunk; missing seam: a per-call seed.
* `checkpoint_manager.save` (`save_metadata_with_checkpoints`): rl/trainer.py `Trainer` takes a
  `custom_checkpoint_metadata_fn`, but it does not do the job: rl/rl_cluster.py
  `RLCluster._init_cluster` sets its own (global_step, role) with no way to add to it,
  sft/peft_trainer.py `PeftTrainer._save_last_checkpoint` (the save on close) passes no
  metadata, and `PeftTrainer.train` calls it on every micro-step (for trace tags), where the
  estimator would be serialised each time instead of once a saved checkpoint.
* the sampler's `init_sample_state` and `_compiled_decode_fn` (`sample_policy`;
  generate/sampler.py `Sampler.__call__` calls both on the instance): the first adds tokens the
  policy may not emit to `forbidden_token_ids` (the vanilla rollout passes none; the sampler
  sets their logits to -inf before sampling); the second records each call's token buffer
  inside `recorded_stops`, where the token that stopped each rollout lies (`Sampler.__call__`
  returns a completion up to, not including, its first stop token, and not which one it was).
  Missing seams: a rollout's forbidden tokens, and the stop token it sampled.
* the rollout model's `config.remat_config` (`without_remat`): generate/sampler.py
  `Sampler._sample_step` merges the model inside the decode loop's body, where an nnx.remat
  layer cannot be traced.
"""

import abc
import contextlib
import contextvars
import dataclasses
import inspect
import warnings
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.generate import sampler as sampler_lib
from tunix.rl import common
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl import utils as rl_utils
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout
from tunix.sft import checkpoint_manager as checkpoint_lib
from tunix.sft import peft_trainer

TESTED_VERSION = "0.1.7"  # the google-tunix this module was written against


class TunixVersionWarning(UserWarning):
  """The installed google-tunix is not the one `tunix_compat` was written against."""


def check_version() -> None:
  """Warns (`TunixVersionWarning`, one line) unless google-tunix TESTED_VERSION is installed.

  A warning, not an error: pyproject allows any google-tunix 0.1, and a new one may still keep
  the internals used here; the learner's exactness tests tell.
  """
  try:
    installed = metadata.version("google-tunix")
  except metadata.PackageNotFoundError:
    installed = "of an unrecorded version"
  if installed != TESTED_VERSION:
    warnings.warn(
        f"SeraLearner reaches into google-tunix {TESTED_VERSION}'s internals "
        f"(sera_jax/settings/llm/tunix_compat.py), but google-tunix {installed} is installed: "
        f"rerun the learner's exactness tests (pytest tests/test_llm.py tests/test_llm_exact.py) "
        f"before trusting its results, or install google-tunix=={TESTED_VERSION}.",
        TunixVersionWarning, stacklevel=2)


class WholeBatchLearner(grpo_learner.GRPOLearner[grpo_learner.TGrpoConfig]):
  """Tunix's GRPO learner that hands a subclass each step's whole batch of prompts.

  A subclass implements `process_batch` (the batch, unrepeated, to TrainExamples) and
  `check_step` (the step's sizes, before its first generation). Tunix gathers a step's
  prompts into one batch only when its rollout and log-prob micro-batches (prompts Tunix
  scores together) and its mini-batch are the batch; `check_step` receives them to refuse
  anything else.
  """

  def __init__(self, *args, **kwargs):
    check_version()
    super().__init__(*args, **kwargs)

  @abc.abstractmethod
  def process_batch(self, batch: dict[str, Any], train_micro_batches: int,
                    mode: rl_cluster_lib.Mode) -> list[common.TrainExample]:
    """The TrainExamples of one batch of prompts (no trajectory ids, no repeats), one a train
    micro-batch, in the order the actor trains them."""

  @abc.abstractmethod
  def check_step(self, batch_size: int, mini_batch_size: int, scored_together: int,
                 train_micro_batches: int) -> None:
    """Raises unless the sizes of a step (prompts in a batch, in a mini-batch, scored in one
    `process_batch` call, and train micro-batches an optimizer step) suit the subclass."""

  @property
  def micro_batch_sizes(self) -> tuple[int | None, int | None]:
    """The rollout and log-prob micro-batch sizes, in prompts, as `train` resolves them."""
    return self._rollout_micro_batch_size, self._compute_logps_micro_batch_size

  def compute_rewards(self, prompts: list[str], completions: list[str],
                      mode: rl_cluster_lib.Mode, **columns) -> np.ndarray:
    """The reward functions' summed rewards of each completion (their metrics buffered)."""
    return self._compute_rewards(prompts=prompts, completions=completions, mode=mode, **columns)

  def _num_generations(self) -> int:
    return 1  # `process_batch` repeats each prompt by its own count

  def _compute_trajectory_ids(self, example, steps: int) -> list[str]:
    return [f"{steps}_{row}" for row in range(len(example["prompts"]))]

  def _process_accumulated_batches(self, micro_batches, micro_batch_sizes, mode):
    if not micro_batches:
      return []
    batch = {key: value for key, value in rl_utils.merge_micro_batches(micro_batches).items()
             if key != "trajectory_ids"}
    return self.process_batch(batch, len(micro_batch_sizes), mode)

  def _run_global_step(self, full_batch_size: int, mini_batch_size: int,
                       service_target_batch_size: int, grad_acc_steps: int, *args, **kwargs):
    self.check_step(full_batch_size, mini_batch_size, service_target_batch_size, grad_acc_steps)
    return super()._run_global_step(full_batch_size, mini_batch_size,
                                    service_target_batch_size, grad_acc_steps, *args, **kwargs)


def training_loss(trainer: peft_trainer.PeftTrainer) -> Callable[[nnx.Module, Any], jax.Array]:
  """The loss `trainer` minimises, (model, example) -> scalar, called as its train step calls
  it (`PeftTrainer._train_step`), its aux output dropped."""

  def loss(model, example):
    out = trainer.loss_fn(model, **trainer.gen_model_input_fn(example))
    return out[0] if trainer._has_aux else out

  return loss


def restored_metadata(trainer: peft_trainer.PeftTrainer) -> dict[str, Any]:
  """The custom metadata of the checkpoint `trainer` resumed from ({} when none)."""
  return trainer._restored_custom_metadata


def save_metadata_with_checkpoints(manager: checkpoint_lib.CheckpointManager, key: str,
                                   state: Callable[[], Any]) -> None:
  """Puts {key: state()} in the custom metadata of every checkpoint `manager` saves.

  Orbax writes a step's metadata into the step's temporary directory and finalizes both with
  one rename, so the state is never behind (or ahead of) the weights it was saved with.
  `state` runs only when a checkpoint is written, and for the save on close too.
  """
  save = manager.save

  def save_with_state(step, *args, force=False, custom_metadata=None, **kwargs):
    orbax = manager._checkpoint_manager  # None when the run has no checkpoint directory
    if orbax is not None and (force or orbax.should_save(step)):
      custom_metadata = {**(custom_metadata or {}), key: state()}
    return save(step, *args, force=force, custom_metadata=custom_metadata, **kwargs)

  manager.save = save_with_state


@dataclasses.dataclass
class _ChunkKeys:
  """The sampling keys of one `RLCluster.generate` call's chunks, drawn in order."""
  key: jax.Array
  drawn: int = 0

  def next(self) -> jax.Array:
    # The first chunk draws with (a copy of: the sampler donates it) the call's key itself, so
    # a call of one chunk samples as it would unpatched with that key.
    key = jax.random.fold_in(self.key, self.drawn) if self.drawn else jnp.copy(self.key)
    self.drawn += 1
    return key


# Set by `chunk_keys` around one generate call, in the thread that makes it (Tunix prepares
# training data in an executor thread, evaluation data on the main one).
_CHUNK_KEYS: contextvars.ContextVar[_ChunkKeys | None] = contextvars.ContextVar(
    "sera_jax_chunk_keys", default=None)


def seed_each_generation(rollout: base_rollout.BaseRollout) -> None:
  """Lets `chunk_keys` give each chunk `rollout` generates its own key.

  Inside `with chunk_keys(key)`, the i-th chunk (i >= 1) samples with fold_in(key, i) and the
  first with key; elsewhere, and with key None, the rollout's config seeds it as before.
  """
  generate = rollout.generate

  def generate_with_own_key(prompts, rollout_config, **kwargs):
    keys = _CHUNK_KEYS.get()
    if keys is not None:
      rollout_config = dataclasses.replace(rollout_config, seed=keys.next())
    return generate(prompts, rollout_config, **kwargs)

  rollout.generate = generate_with_own_key


@contextlib.contextmanager
def chunk_keys(key: jax.Array | None) -> Iterator[None]:
  """Seeds the chunks of the generate calls in the block from `key` (see
  `seed_each_generation`); None leaves them to the rollout config."""
  token = _CHUNK_KEYS.set(None if key is None else _ChunkKeys(key))
  try:
    yield
  finally:
    _CHUNK_KEYS.reset(token)


@contextlib.contextmanager
def without_remat(model: nnx.Module) -> Iterator[None]:
  """Traces `model` without rematerialisation (remat_config NONE) inside the block.

  Rematerialisation only saves memory for a backward pass, which generation does not take.
  Tunix's models read config.remat_config when traced, from one config their layers share.
  A model without one is left as it is.
  """
  config = getattr(model, "config", None)
  remat = getattr(config, "remat_config", None)
  if remat is None:
    yield
    return
  # object.__setattr__: Tunix's Llama ModelConfig is a frozen dataclass (its Qwens' are not).
  object.__setattr__(config, "remat_config", type(remat).NONE)
  try:
    yield
  finally:
    object.__setattr__(config, "remat_config", remat)


# Finite, so log-probabilities and their gradients stay finite, and far enough below any logit
# that exp(MASKED_LOGIT - max) is exactly 0 in float32, as exp(-inf) is in the sampler.
MASKED_LOGIT = -1e9


class PolicyLogits(nnx.Module):
  """The logits of the law the learner samples: `model`'s, `forbidden` tokens masked (the
  sampler's forbidden tokens), divided by `temperature`.

  Called as a Tunix model, (tokens, positions, cache, attention_mask, ...) -> (logits, cache);
  keyword arguments `model` does not take (Tunix passes segment_ids to any model whose call
  takes **kwargs) are dropped.
  """

  def __init__(self, model: nnx.Module, forbidden: Sequence[int], temperature: float = 1.0):
    self.model = model
    self.forbidden = tuple(int(token) for token in forbidden)
    self.temperature = float(temperature)

  def __call__(self, input_tokens, positions, cache, attention_mask=None, **kwargs):
    accepted = inspect.signature(self.model.__call__).parameters
    kwargs = {name: value for name, value in kwargs.items() if name in accepted}
    logits, cache = self.model(input_tokens, positions, cache, attention_mask, **kwargs)
    if self.forbidden:
      masked = np.isin(np.arange(logits.shape[-1]), self.forbidden)
      logits = jnp.where(masked, jnp.asarray(MASKED_LOGIT, logits.dtype), logits)
    if self.temperature != 1.0:
      logits = logits / jnp.asarray(self.temperature, logits.dtype)
    return logits, cache


def score_policy(trainer: peft_trainer.PeftTrainer, forbidden: Sequence[int]) -> None:
  """Makes `trainer`'s loss (Tunix's policy loss of the actor model) score `PolicyLogits` of
  the model with `forbidden` masked; Tunix's loss divides by the temperature itself."""
  if not forbidden:
    return
  loss = trainer.loss_fn

  # GRPOLearner's loss signature: PeftTrainer's nnx.grad binds the keywords to positions.
  def loss_of_policy(model, train_example, algo_config):
    return loss(PolicyLogits(model, forbidden), train_example, algo_config)

  trainer.with_loss_fn(loss_of_policy, has_aux=trainer._has_aux)


@dataclasses.dataclass
class _Buffers:
  """The token buffers of the sampler calls of one `recorded_stops` block, in order."""
  buffers: list[jax.Array] = dataclasses.field(default_factory=list)


_BUFFERS: contextvars.ContextVar[_Buffers | None] = contextvars.ContextVar(
    "sera_jax_token_buffers", default=None)


def sample_policy(rollout: base_rollout.BaseRollout, forbidden: Sequence[int]) -> None:
  """Makes `rollout`'s sampler never emit `forbidden` and lets `recorded_stops` read the token
  that stopped each of its rollouts. Raises TypeError unless `rollout` is Tunix's vanilla
  rollout (rollout_engine "vanilla"), whose sampler is the one patched."""
  sampler = getattr(rollout, "_sampler", None)
  if not isinstance(sampler, sampler_lib.Sampler):
    raise TypeError(f"SeraLearner reads the stop token each rollout sampled from Tunix's "
                    f"vanilla sampler: use rollout_engine='vanilla' (got "
                    f"{type(rollout).__name__}).")
  init, decode = sampler.init_sample_state, sampler._compiled_decode_fn
  extra = tuple(int(token) for token in forbidden)

  def init_forbidding(*args, forbidden_token_ids=None, **kwargs):
    ids = tuple(sorted({*(forbidden_token_ids or ()), *extra})) or None
    return init(*args, forbidden_token_ids=ids, **kwargs)

  def decode_recording(*args, **kwargs):
    state = decode(*args, **kwargs)
    record = _BUFFERS.get()
    if record is not None:
      record.buffers.append(state.token_buffer)
    return state

  sampler.init_sample_state = init_forbidding
  sampler._compiled_decode_fn = decode_recording


@contextlib.contextmanager
def recorded_stops() -> Iterator[Callable[[Sequence[np.ndarray], int], np.ndarray]]:
  """Records the sampler calls in the block (of a rollout `sample_policy` patched); yields
  stops(tokens, limit): the token that stopped each of the completions `tokens` (the calls'
  in order, as `RLCluster.generate` concatenates them) and -1 for one cut off at `limit`
  tokens. A completion of `limit` tokens was cut off: the sampler stops at a stop token only
  within its max_tokens_to_generate."""
  record = _Buffers()
  token = _BUFFERS.set(record)

  def stops(tokens: Sequence[np.ndarray], limit: int) -> np.ndarray:
    rows = [row for buffer in record.buffers for row in np.asarray(buffer)]
    if len(rows) != len(tokens):
      raise RuntimeError(f"{len(tokens)} completions but {len(rows)} sampled rows recorded: "
                         f"was the rollout patched by tunix_compat.sample_policy?")
    # Each buffer is [prompt width + limit]; a completion starts after the prompt width.
    return np.array([row[len(row) - limit + len(completion)] if len(completion) < limit
                     else -1 for row, completion in zip(rows, tokens, strict=True)], np.int64)

  try:
    yield stops
  finally:
    _BUFFERS.reset(token)
