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
  its EOS back and keep its length) and a way to return rewards and completions with the
  example.

Private members read (no public accessor in 0.1.7):

* `RLLearner._rollout_micro_batch_size`, `_compute_logps_micro_batch_size` (set by
  `RLLearner.train`): `WholeBatchLearner.micro_batch_sizes`;
* `RLLearner._compute_rewards` (rl/rl_learner.py): `WholeBatchLearner.compute_rewards`;
* `PeftTrainer._has_aux` (sft/peft_trainer.py, set by `with_loss_fn`): `training_loss`;
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
* the rollout model's `config.remat_config` (`without_remat`): generate/sampler.py
  `Sampler._sample_step` merges the model inside the decode loop's body, where an nnx.remat
  layer cannot be traced.
"""

import abc
import contextlib
import contextvars
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
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
  config.remat_config = type(remat).NONE
  try:
    yield
  finally:
    config.remat_config = remat
