"""GSM8K with a pretrained Qwen3 (or Qwen2) through `SeraLearner`: the paper's LLM setting.

Sized for an accelerator host, not a CPU. Its config is the shipped `gsm8k_qwen3`
(sera_jax/harness/configs), which `sera-jax train --config gsm8k_qwen3 --config.model_dir=DIR
--config.data_dir=TFDS_DIR` trains, where DIR (local or gs://) holds the model's Hugging Face
safetensors checkpoint and tokenizer files and TFDS_DIR holds gsm8k prepared by `tfds build
gsm8k --data_dir=TFDS_DIR`. Nothing here downloads a model or a dataset.

* Data: tfds "gsm8k" train split, read once into memory; each question with `INSTRUCTION` in
  the tokenizer's chat template, the answer the number after "####", the dataset index the
  example's position in the split, served M a step by `learner.epoch_batches`.
* `exact_reward`: 1 when the last number of the completion equals the answer
  (`grading.number_reward`).
* `load_pretrained`: the model through Tunix's safetensors loader of its family and the
  tokenizer through Tunix's Hugging Face adapter, both from config.model_dir.
* `build_learner`, `train`: the RLCluster of `cluster.build` on a (fsdp, tp) mesh and the
  learner, its SeraConfig from the config's keys (`sera_jax.settings.llm.config`); the model
  and tokenizer are seams, so the tests train a tiny stand-in.
"""

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from etils import epath
from flax import nnx
from tunix.generate import tokenizer_adapter
from tunix.models.qwen2 import model as qwen2_model
from tunix.models.qwen2 import params as qwen2_params
from tunix.models.qwen3 import model as qwen3_model
from tunix.models.qwen3 import params as qwen3_params
from tunix.rl.rollout import base_rollout

from sera_jax.common import files, optim
from sera_jax.common.data.tfds_images import (
    tensorflow_and_tfds,
    tfds_is_mocked,
    unprepared_message,
)
from sera_jax.method import validation
from sera_jax.settings.llm import cluster as cluster_lib
from sera_jax.settings.llm import config as llm_config
from sera_jax.settings.llm import grading
from sera_jax.settings.llm import learner as learner_lib

GSM8K = "gsm8k"
# Tunix's model module (ModelConfig presets, RematConfig) and safetensors loader of each family.
FAMILIES = {"qwen3": (qwen3_model, qwen3_params), "qwen2": (qwen2_model, qwen2_params)}
REMATS = ("none", "block", "decoder")
_REQUIRED = {
    "model_dir": "a local or gs:// directory with the model's Hugging Face *.safetensors "
                 "checkpoint and tokenizer files",
    "data_dir": f"the tfds data_dir (local or gs://) where `tfds build {GSM8K} "
                f"--data_dir=...` prepared {GSM8K}",
}
INSTRUCTION = ("Solve the problem step by step, then write the final answer as a plain number "
               "at the very end.")


def _require(config: ml_collections.ConfigDict, key: str) -> None:
  if not config[key]:
    raise ValueError(f"config.{key} is required: {_REQUIRED[key]}.")


# ---- data ---------------------------------------------------------------------------------


# The final answer of a GSM8K solution: the number after "####", commas removed.
answer_number = grading.gsm8k_answer


def read_gsm8k(data_dir: str, split: str = "train") -> tuple[list[str], list[str]]:
  """(questions, final answers) of a split of tfds gsm8k in data_dir, in the split's order.

  Raises:
    FileNotFoundError: gsm8k is not prepared in data_dir (the message says how to).
  """
  _, tfds = tensorflow_and_tfds()  # TensorFlow with the GPUs hidden
  builder = tfds.builder(GSM8K, data_dir=data_dir)
  if not (builder.is_prepared() or tfds_is_mocked(tfds)):
    raise FileNotFoundError(unprepared_message(GSM8K, data_dir))
  examples = list(tfds.as_numpy(builder.as_dataset(split=split)))
  return ([example["question"].decode() for example in examples],
          [answer_number(example["answer"].decode()) for example in examples])


def prompt(question: str, tokenizer, *, enable_thinking: bool = False,
           instruction: str = INSTRUCTION) -> str:
  """The question and `instruction`, as a user turn of the tokenizer's chat template if any."""
  text = f"{question.strip()}\n{instruction}"
  if getattr(tokenizer, "chat_template", None) is None:
    return text
  return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True,
                                       enable_thinking=enable_thinking)


def problems(questions: Sequence[str], answers: Sequence[str], tokenizer, *,
             max_prompt_length: int, enable_thinking: bool = False,
             instruction: str = INSTRUCTION) -> dict[str, np.ndarray]:
  """The batch columns of every problem: "prompts" (`prompt` with `instruction`), "answer" and
  "idx" (0..P-1).

  Raises:
    ValueError: a prompt is longer than max_prompt_length tokens (Tunix's sampler would
      otherwise fail on the KV cache when a batch first holds it).
  """
  prompts = [prompt(q, tokenizer, enable_thinking=enable_thinking, instruction=instruction)
             for q in questions]
  # Tokens as Tunix's sampler counts them: BOS (when the tokenizer has one), then the text.
  lengths = [len(tokenizer.encode(p)) + bool(tokenizer.bos_id()) for p in prompts]
  longest = int(np.argmax(lengths))
  if lengths[longest] > max_prompt_length:
    raise ValueError(f"problem {longest}'s prompt has {lengths[longest]} tokens, more than "
                     f"config.max_prompt_length={max_prompt_length}; raise it (and "
                     f"config.kv_cache_size).")
  return {"prompts": np.array(prompts), "answer": np.array(answers),
          "idx": np.arange(len(prompts), dtype=np.int64)}


# ---- reward -------------------------------------------------------------------------------


# 1 when the completion's last number equals the answer as a number (18.00 == 18), else 0.
exact_reward = grading.number_reward


# ---- model and tokenizer ------------------------------------------------------------------


def preset_config(config: ml_collections.ConfigDict):
  """The family's ModelConfig preset config.model_preset with the config's dtypes and remat."""
  validation.choice("config.model_family", config.model_family, tuple(FAMILIES))
  model_lib = FAMILIES[config.model_family][0]
  presets = tuple(name for name, value in vars(model_lib.ModelConfig).items()
                  if isinstance(value, classmethod) and not name.startswith("_"))
  validation.choice("config.model_preset", config.model_preset, presets)
  validation.choice("config.remat", config.remat, REMATS)
  return dataclasses.replace(getattr(model_lib.ModelConfig, config.model_preset)(),
                             dtype=jnp.dtype(config.dtype),
                             param_dtype=jnp.dtype(config.param_dtype),
                             remat_config=model_lib.RematConfig[config.remat.upper()])


@contextlib.contextmanager
def _local_dir(model_dir: str) -> Iterator[str]:
  """`model_dir` itself when local, else a temporary local copy of its files (not subfolders).

  Tunix's loader would fetch a gs:// directory through fsspec's gcsfs, which is no dependency
  here, and Hugging Face's AutoTokenizer reads a local directory or a hub id, never a URL: so
  a URL is copied through epath, like every file a run reads.
  """
  if not files.is_url(model_dir):
    yield os.fspath(files.path(model_dir))
    return
  with tempfile.TemporaryDirectory() as local:
    for source in files.path(model_dir).iterdir():
      if source.is_file():
        source.copy(epath.Path(local) / source.name)
    yield local


def load_pretrained(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, *,
                    model_config=None) -> tuple[nnx.Module, tokenizer_adapter.Tokenizer]:
  """(model, tokenizer) from config.model_dir, the model sharded over `mesh`.

  Args:
    config: reads model_dir, model_family and (unless model_config is given) the preset.
    mesh: the model's mesh.
    model_config: the family's ModelConfig; default `preset_config(config)`.

  Raises:
    ValueError: config.model_dir is empty.
    FileNotFoundError: it does not exist or holds no *.safetensors file.
  """
  _require(config, "model_dir")
  if not files.path(config.model_dir).exists():
    raise FileNotFoundError(f"config.model_dir {config.model_dir} does not exist.")
  model_config = model_config or preset_config(config)
  with _local_dir(config.model_dir) as local:
    if not list(epath.Path(local).glob("*.safetensors")):
      raise FileNotFoundError(f"config.model_dir {config.model_dir} holds no *.safetensors "
                              f"checkpoint.")
    # add_bos/add_eos False: the sampler adds BOS itself; an EOS ends no prompt.
    tokenizer = tokenizer_adapter.Tokenizer(tokenizer_type="huggingface", tokenizer_path=local,
                                            add_bos=False, add_eos=False)
    model = FAMILIES[config.model_family][1].create_model_from_safe_tensors(
        local, model_config, mesh, dtype=model_config.param_dtype)
  return model, tokenizer


def stop_ids(tokenizer, stop_tokens: Sequence[str]) -> list[int]:
  """EOS and the ids of `stop_tokens`, each of which must be one token of the vocabulary."""
  ids = {tokenizer.eos_id()}
  for token in stop_tokens:
    encoded = tokenizer.encode(token)
    if len(encoded) != 1:
      raise ValueError(f"stop token {token!r} is {len(encoded)} tokens of this tokenizer, not "
                       f"one; set config.stop_tokens.")
    ids.add(encoded[0])
  return sorted(ids)


# ---- the learner --------------------------------------------------------------------------


def make_mesh(config: ml_collections.ConfigDict) -> jax.sharding.Mesh:
  """The ("fsdp", "tp") mesh of config.mesh_shape over every device."""
  fsdp, tp = config.mesh_shape
  tp = validation.integer("config.mesh_shape[1] (tp)", tp, minimum=1)
  fsdp = jax.device_count() // tp if fsdp == -1 else fsdp
  if fsdp * tp != jax.device_count():
    raise ValueError(f"config.mesh_shape {tuple(config.mesh_shape)} does not cover the "
                     f"{jax.device_count()} devices.")
  return cluster_lib.make_mesh((fsdp, tp))


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """The actor's optimizer: gradients clipped to config.grad_clip_norm, then
  `sera_jax.common.optim`'s of the config (AdamW at a constant 1e-6 by default)."""
  return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm),
                     optim.make_optimizer(config))


def rollout_config(config: ml_collections.ConfigDict,
                   eos_tokens: Sequence[int]) -> base_rollout.RolloutConfig:
  """Tunix's rollouts of the config: its lengths, KV cache and temperature, stopping at any of
  `eos_tokens` (`stop_ids`)."""
  return base_rollout.RolloutConfig(
      max_tokens_to_generate=config.max_tokens_to_generate,
      max_prompt_length=config.max_prompt_length, kv_cache_size=config.kv_cache_size,
      temperature=config.temperature, top_p=1.0, eos_tokens=list(eos_tokens))


def build_learner(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, *,
                  model: nnx.Module | None = None, tokenizer=None
                  ) -> tuple[learner_lib.SeraLearner, Iterator[dict[str, np.ndarray]]]:
  """The SeraLearner of `config` on GSM8K's training split, and the batches it trains on.

  The data is read and the SERA and optimizer keys are checked before the model loads, so
  those mistakes fail at once.

  Args:
    config: the keys of the shipped config `gsm8k_qwen3` (sera_jax/harness/configs).
    mesh: every role's mesh (`make_mesh`).
    model, tokenizer: the policy and its tokenizer; default (both None) config.model_dir's.
  """
  if (model is None) != (tokenizer is None):
    raise ValueError("pass both a model and its tokenizer, or neither (config.model_dir's).")
  if model is None:
    _require(config, "model_dir")
  _require(config, "data_dir")
  needed = config.max_prompt_length + config.max_tokens_to_generate
  if config.kv_cache_size < needed:
    raise ValueError(f"config.kv_cache_size must be >= max_prompt_length + "
                     f"max_tokens_to_generate = {needed}; got {config.kv_cache_size}.")
  questions, answers = read_gsm8k(config.data_dir)
  algo_config = llm_config.sera_config(config, dataset_size=len(questions))
  optimizer = make_optimizer(config)
  if model is None:
    model, tokenizer = load_pretrained(config, mesh)
  columns = problems(questions, answers, tokenizer, max_prompt_length=config.max_prompt_length,
                     enable_thinking=config.enable_thinking)
  train_batches = learner_lib.epoch_batches(columns, config.batch_size, config.seed)
  cluster = cluster_lib.build(
      model, tokenizer, mesh, optimizer=optimizer, max_steps=config.num_steps,
      rollout_config=rollout_config(config, stop_ids(tokenizer, config.stop_tokens)),
      checkpoint_dir=config.checkpoint_dir or None,
      save_every=config.checkpoint_every, max_to_keep=config.checkpoints_to_keep,
      log_dir=config.log_dir or None, batch_size=config.batch_size,
      train_micro_batch_size=config.train_micro_batch_size)
  return learner_lib.SeraLearner(cluster, algo_config, exact_reward), train_batches


def train(config: ml_collections.ConfigDict, *, model: nnx.Module | None = None,
          tokenizer=None) -> learner_lib.SeraLearner:
  """Trains to config.num_steps (resuming config.checkpoint_dir); returns the learner."""
  mesh = make_mesh(config)
  learner, train_batches = build_learner(config, mesh, model=model, tokenizer=tokenizer)
  with jax.set_mesh(mesh):
    learner.train(train_batches)
  return learner
