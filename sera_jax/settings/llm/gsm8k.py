"""The LLM setting's training entry: a pretrained Qwen3, Qwen2/2.5 or Llama (SmolLM2) trained
on math problems through `SeraLearner`.

Sized for an accelerator host, not a CPU. Its configs are the shipped LLM configs
(sera_jax/harness/configs: `gsm8k_qwen3`, `gsm8k_smollm2`, `math_qwen25`, `polaris_qwen3`),
which `sera-jax train --config NAME --config.model_dir=DIR` trains, where DIR (local or gs://)
holds the model's Hugging Face safetensors checkpoint and tokenizer files, and the problems are
config.data_file (a Parquet or JSONL file in config.data_format, `data`) or, when it is "",
tfds gsm8k prepared in config.data_dir by `tfds build gsm8k --data_dir=...`. Nothing here
downloads a model or a dataset.

* Data (`read_problems`): read once into memory; each question with the config's instruction
  (default its grader's, `data.INSTRUCTIONS`) in the tokenizer's chat template, the dataset
  index the problem's position in the file, served M a step by `learner.epoch_batches`.
* Reward: `exact_reward` (1 when the last number of the completion equals the answer,
  `grading.number_reward`) for tfds gsm8k and the "gsm8k" format; math-verify in
  `grading.MathGrader`'s worker processes for the others.
* `load_pretrained`: the model (`preset_config`: a ModelConfig preset of its family, with
  config.model_kwargs) through Tunix's safetensors loader of its family, and the tokenizer
  through Tunix's Hugging Face adapter, both from config.model_dir.
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
from tunix.models.llama3 import model as llama3_model
from tunix.models.llama3 import params as llama3_params
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
from sera_jax.settings.llm import data, grading
from sera_jax.settings.llm import learner as learner_lib
from sera_jax.settings.llm.data import INSTRUCTION, problems, prompt  # noqa: F401 (GSM8K's)

GSM8K = "gsm8k"
# Tunix's model module (ModelConfig presets, RematConfig) and safetensors loader of each family:
# Qwen3, Qwen2 and Qwen2.5 (Qwen2.5-Math too), and Llama, whose architecture SmolLM2 shares.
FAMILIES = {"qwen3": (qwen3_model, qwen3_params), "qwen2": (qwen2_model, qwen2_params),
            "llama3": (llama3_model, llama3_params)}
REMATS = ("none", "block", "decoder")
_REQUIRED = {
    "model_dir": "a local or gs:// directory with the model's Hugging Face *.safetensors "
                 "checkpoint and tokenizer files",
    "data_dir": f"the tfds data_dir (local or gs://) where `tfds build {GSM8K} "
                f"--data_dir=...` prepared {GSM8K} (or set config.data_file, a problem file)",
}


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


# ---- reward -------------------------------------------------------------------------------


# 1 when the completion's last number equals the answer as a number (18.00 == 18), else 0.
exact_reward = grading.number_reward


# ---- model and tokenizer ------------------------------------------------------------------


def preset_config(config: ml_collections.ConfigDict):
  """The family's ModelConfig: the preset config.model_preset (none: "") with the fields of
  config.model_kwargs, the config's dtypes and remat.

  Raises:
    ValueError: an unknown family, preset, remat or ModelConfig field; no preset and
      model_kwargs that miss a field; or a family whose ModelConfig has no dtype (Tunix's
      Llama computes in its weights' dtype) with config.dtype != config.param_dtype.
  """
  validation.choice("config.model_family", config.model_family, tuple(FAMILIES))
  model_lib = FAMILIES[config.model_family][0]
  presets = tuple(name for name, value in vars(model_lib.ModelConfig).items()
                  if isinstance(value, classmethod) and not name.startswith("_"))
  if config.model_preset:
    validation.choice("config.model_preset", config.model_preset, presets)
  validation.choice("config.remat", config.remat, REMATS)
  fields = {field.name for field in dataclasses.fields(model_lib.ModelConfig)}
  kwargs = dict(config.model_kwargs)
  unknown = sorted(set(kwargs) - fields)
  if unknown:
    raise ValueError(f"config.model_kwargs: {config.model_family}'s ModelConfig has no field "
                     f"{', '.join(unknown)} (fields: {', '.join(sorted(fields))}).")
  kwargs["remat_config"] = model_lib.RematConfig[config.remat.upper()]
  if "dtype" in fields:
    kwargs |= {"dtype": jnp.dtype(config.dtype), "param_dtype": jnp.dtype(config.param_dtype)}
  elif config.dtype != config.param_dtype:
    raise ValueError(f"Tunix's {config.model_family} computes in its weights' dtype: set "
                     f"config.dtype = config.param_dtype ({config.param_dtype}); got "
                     f"{config.dtype}.")
  if config.model_preset:
    return dataclasses.replace(getattr(model_lib.ModelConfig, config.model_preset)(), **kwargs)
  try:
    return model_lib.ModelConfig(**kwargs)
  except TypeError as error:
    raise ValueError(f"config.model_preset is empty, so config.model_kwargs must give every "
                     f"field of {config.model_family}'s ModelConfig: {error}.") from None


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
    tokenizer = load_tokenizer(config, local)
    model = FAMILIES[config.model_family][1].create_model_from_safe_tensors(
        local, model_config, mesh,
        # Tunix's Llama has no param_dtype: its weights load in config.param_dtype.
        dtype=getattr(model_config, "param_dtype", jnp.dtype(config.param_dtype)))
  return model, tokenizer


def load_tokenizer(config: ml_collections.ConfigDict,
                   directory: str) -> tokenizer_adapter.Tokenizer:
  """The Hugging Face tokenizer files in `directory` through Tunix's adapter, padding with
  config.pad_token when it names one (its own pad token otherwise).

  Tunix's sampler and loss mask every pad id out of a sequence, so a pad token the prompts
  hold (a chat template's end of turn, where a tokenizer pads with its EOS) would vanish from
  them: `data.problems` refuses such prompts, and config.pad_token names another.
  """
  # add_bos/add_eos False: the sampler adds BOS itself; an EOS ends no prompt.
  tokenizer = tokenizer_adapter.Tokenizer(tokenizer_type="huggingface", tokenizer_path=directory,
                                          add_bos=False, add_eos=False)
  if config.get("pad_token"):
    token_id(tokenizer, config.pad_token, "config.pad_token")
    tokenizer.tokenizer.pad_token = config.pad_token
  return tokenizer


def token_id(tokenizer, token: str, key: str) -> int:
  """The id of `token` (the value of config `key`), which must be one token of `tokenizer`."""
  encoded = tokenizer.encode(token)
  if len(encoded) != 1:
    raise ValueError(f"{key}: {token!r} is {len(encoded)} tokens of this tokenizer, not one.")
  return encoded[0]


def stop_ids(tokenizer, stop_tokens: Sequence[str]) -> list[int]:
  """EOS and the ids of `stop_tokens`, each of which must be one token of the vocabulary."""
  return sorted({tokenizer.eos_id()} | {token_id(tokenizer, token, "config.stop_tokens")
                                        for token in stop_tokens})


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


def read_problems(config: ml_collections.ConfigDict):
  """The training problems (a `data.Problems`): config.data_file in config.data_format, or,
  when data_file is "", tfds gsm8k's train split in config.data_dir, graded by the number."""
  if config.data_file:
    return data.load(config.data_file, config.data_format)
  _require(config, "data_dir")
  questions, answers = read_gsm8k(config.data_dir)
  return data.Problems(questions, answers, np.arange(len(questions), dtype=np.int64), "number")


def build_learner(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, *,
                  model: nnx.Module | None = None, tokenizer=None,
                  grader: grading.MathGrader | None = None
                  ) -> tuple[learner_lib.SeraLearner, Iterator[dict[str, np.ndarray]]]:
  """The SeraLearner of `config` on its training problems (`read_problems`), and the batches
  it trains on.

  The data is read and the SERA and optimizer keys are checked before the model loads, so
  those mistakes fail at once. A problem file graded by the number is rewarded by
  `exact_reward`, one graded by math-verify by `grader`'s workers.

  Args:
    config: the keys of the shipped LLM configs (`gsm8k_qwen3`, sera_jax/harness/configs).
    mesh: every role's mesh (`make_mesh`).
    model, tokenizer: the policy and its tokenizer; default (both None) config.model_dir's.
    grader: the math grader of a math-graded problem file (`train` opens one).
  """
  if (model is None) != (tokenizer is None):
    raise ValueError("pass both a model and its tokenizer, or neither (config.model_dir's).")
  if model is None:
    _require(config, "model_dir")
  needed = config.max_prompt_length + config.max_tokens_to_generate
  if config.kv_cache_size < needed:
    raise ValueError(f"config.kv_cache_size must be >= max_prompt_length + "
                     f"max_tokens_to_generate = {needed}; got {config.kv_cache_size}.")
  training = read_problems(config)
  if training.grader == "math" and grader is None:
    raise ValueError(f"{config.data_file} is graded by math-verify: pass a grading.MathGrader "
                     f"(train opens one).")
  reward = exact_reward if training.grader == "number" else grader.math_reward
  algo_config = llm_config.sera_config(config, dataset_size=len(training.questions))
  optimizer = make_optimizer(config)
  if model is None:
    model, tokenizer = load_pretrained(config, mesh)
  columns = data.columns(training, tokenizer, max_prompt_length=config.max_prompt_length,
                         enable_thinking=config.enable_thinking,
                         instruction=config.instruction or None)
  train_batches = learner_lib.epoch_batches(columns, config.batch_size, config.seed)
  cluster = cluster_lib.build(
      model, tokenizer, mesh, optimizer=optimizer, max_steps=config.num_steps,
      rollout_config=rollout_config(config, stop_ids(tokenizer, config.stop_tokens)),
      checkpoint_dir=config.checkpoint_dir or None,
      save_every=config.checkpoint_every, max_to_keep=config.checkpoints_to_keep,
      log_dir=config.log_dir or None, batch_size=config.batch_size,
      train_micro_batch_size=config.train_micro_batch_size)
  return learner_lib.SeraLearner(cluster, algo_config, reward), train_batches


def train(config: ml_collections.ConfigDict, *, model: nnx.Module | None = None,
          tokenizer=None) -> learner_lib.SeraLearner:
  """Trains to config.num_steps (resuming config.checkpoint_dir); returns the learner. A
  math-graded problem file is graded in config.grading_processes worker processes."""
  mesh = make_mesh(config)
  with contextlib.ExitStack() as stack:
    grader = None
    if config.data_file and data.FORMATS[config.data_format].grader == "math":
      grader = stack.enter_context(grading.MathGrader(config.grading_processes))
    learner, train_batches = build_learner(config, mesh, model=model, tokenizer=tokenizer,
                                           grader=grader)
    with jax.set_mesh(mesh):
      learner.train(train_batches)
  return learner
