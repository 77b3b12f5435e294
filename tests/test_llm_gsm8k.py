"""The GSM8K setting (the [llm] extra): the shipped config `gsm8k_qwen3` and its translation
into SeraConfig, `sera-jax train` on it, the exact reward, the data under
`tfds.testing.mock_data`, the model and tokenizer read from a local or gs:// model_dir, and one
SeraLearner step on a tiny random Qwen3 with a byte-level Hugging Face tokenizer."""

import dataclasses

import gcs_double
import jax
import numpy as np
import pytest
import safetensors.numpy
import tensorflow_datasets as tfds
from flax import nnx
from tiny_qwen import TINY, hf_checkpoint, save_tokenizer
from tunix.models.qwen3 import model as qwen3

from sera_jax.common.tf import tensorflow
from sera_jax.harness import cli, configs
from sera_jax.harness.configs import gsm8k_qwen3
from sera_jax.settings.llm import config as llm_config
from sera_jax.settings.llm import gsm8k, tiny

# GSM8K-shaped problems, thousands separators included: a + b pens.
PENS = [(1200, 300), (7, 5), (45, 1955), (3, 4), (250, 250), (9, 0), (1000, 24), (12, 30)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  directory = tmp_path_factory.mktemp("tokenizer")
  save_tokenizer(directory)
  return directory


@pytest.fixture
def tokenizer(tokenizer_dir):
  """The stand-in through Tunix's Hugging Face adapter, as `load_pretrained` builds it."""
  return gsm8k.load_tokenizer(configs.load("gsm8k_qwen3"), str(tokenizer_dir))


@pytest.fixture
def mocked_gsm8k():
  """tfds gsm8k serves the PENS problems (mock_data's random text has no "#### answer")."""
  tf = tensorflow()
  questions = [f"A shop sold {a:,} pens on Monday and {b:,} on Tuesday. How many pens did it "
               f"sell?" for a, b in PENS]
  solutions = [f"{a:,} + {b:,} = <<{a}+{b}={a + b}>>{a + b:,}\n#### {a + b:,}" for a, b in PENS]

  def as_dataset(self, *args, **kwargs):
    return tf.data.Dataset.from_tensor_slices({
        "question": questions, "answer": solutions, "annotation": [""] * len(PENS),
        "short_answer": [f"{a + b:,}" for a, b in PENS]})

  with tfds.testing.mock_data(as_dataset_fn=as_dataset):
    yield


def test_the_shipped_config_is_the_papers_batch_and_builds_a_valid_sera_config():
  config = configs.load("gsm8k_qwen3")
  assert (config.batch_size, config.baseline_n, config.n_min, config.n_max) == (256, 16, 2, 64)
  assert (config.method, config.estimator, config.temperature) == ("sera", "maxrl", 1.0)
  assert config.learning_rate == 1e-6 and config.optimizer == "adam"
  assert config.kv_cache_size >= config.max_prompt_length + config.max_tokens_to_generate
  with pytest.raises(AttributeError):
    config.batch_sise = 8  # locked: a misspelt key fails
  sera = llm_config.sera_config(config, dataset_size=gsm8k_qwen3.GSM8K_TRAIN)
  assert (sera.num_generations, sera.n_max, sera.dataset_size) == (16, 64, 7_473)
  model = gsm8k.preset_config(config)
  assert dataclasses.replace(model, dtype=np.float32, remat_config=qwen3.RematConfig.NONE) == \
      qwen3.ModelConfig.qwen3_1p7b()
  assert model.param_dtype == np.float32 and model.dtype == jax.numpy.bfloat16
  config.model_family, config.model_preset = "qwen2", "qwen2p5_1p5b_instruct"
  assert gsm8k.preset_config(config).num_layers == 28
  config.model_preset = "qwen3_1p7b"
  with pytest.raises(ValueError, match="model_preset must be one of .*qwen2p5_7b"):
    gsm8k.preset_config(config)


def test_the_config_keys_reach_the_sera_config_under_their_learner_names():
  config = configs.load("gsm8k_qwen3")
  assert set(llm_config.FIELDS) - set(config) == {"align_every"}  # no exact log p on GSM8K
  config.update(method="uniform", baseline_n=8, estimator="grpo", threshold=0.1, discount=0.5,
                alpha0=2.0, beta0=3.0, normalize_by_rho=True, rollout_seed=7,
                generation_batch_size=64)
  sera = llm_config.sera_config(config, dataset_size=100)
  assert (sera.allocation, sera.num_generations, sera.estimator, sera.threshold) == (
      "uniform", 8, "grpo", 0.1)
  assert (sera.discount, sera.alpha0, sera.beta0, sera.normalize_by_rho) == (0.5, 2.0, 3.0, True)
  assert (sera.rollout_seed, sera.generation_batch_size, sera.align_every) == (7, 64, 0)
  with pytest.raises(TypeError, match="set config.method in the config"):
    llm_config.sera_config(config, dataset_size=100, allocation="sera")
  config.method = "greedy"
  with pytest.raises(ValueError, match="greedy"):  # the learner validates what it is given
    llm_config.sera_config(config, dataset_size=100)


@pytest.mark.parametrize("completion, answer, reward", [
    ("So she sold 48 + 24 = 72 clips.", "72", 1.0),
    ("The total is $1,234.", "1234", 1.0),
    ("It costs $18.00", "18", 1.0),
    ("The answer is **1,000,000**", "1000000", 1.0),
    ("\\boxed{-3}", "-3", 1.0),
    ("0.50 of the cake", "0.5", 1.0),
    ("5 apples, then 3 more: 8\n\nDone in 2 steps", "8", 0.0),  # the last number counts
    ("1,2,3", "123", 0.0),  # not thousands separators: the last number is 3
    ("1,2,3", "3", 1.0),
    ("seventy-two", "72", 0.0),
    ("", "0", 0.0),
])
def test_exact_reward_compares_the_last_number(completion, answer, reward):
  assert gsm8k.exact_reward(["q"], [completion], [answer]) == [reward]


def test_the_answer_is_the_number_after_the_hashes():
  assert gsm8k.answer_number("48/2 = <<48/2=24>>24\n#### 1,200") == "1200"
  assert gsm8k.answer_number("#### -7 ") == "-7"
  for bad in ("no final answer", "#### seven"):
    with pytest.raises(ValueError, match="#### <number>"):
      gsm8k.answer_number(bad)


@pytest.mark.slow
def test_problems_read_from_mocked_gsm8k_in_the_chat_template(tmp_path, mocked_gsm8k, tokenizer):
  questions, answers = gsm8k.read_gsm8k(str(tmp_path / "tfds"))
  assert answers == [str(a + b) for a, b in PENS]
  columns = gsm8k.problems(questions, answers, tokenizer, max_prompt_length=256)
  np.testing.assert_array_equal(columns["idx"], np.arange(len(PENS)))
  first = columns["prompts"][0]
  assert first == (f"<|im_start|>user\n{questions[0]}\n{gsm8k.INSTRUCTION}<|im_end|>\n"
                   f"<|im_start|>assistant\n")
  assert gsm8k.prompt("What is 2+3?", tiny.CharTokenizer()) == \
      f"What is 2+3?\n{gsm8k.INSTRUCTION}"  # no chat template: the plain text
  with pytest.raises(ValueError, match="raise it"):
    gsm8k.problems(questions, answers, tokenizer, max_prompt_length=100)


def test_an_unprepared_data_dir_says_how_to_prepare_it(tmp_path):
  with pytest.raises(FileNotFoundError, match="tfds build gsm8k --data_dir="):
    gsm8k.read_gsm8k(str(tmp_path / "tfds"))


@pytest.mark.parametrize("argv, message", [
    (["--config.data_dir=/data"], "config.model_dir is required"),
    (["--config.model_dir=/model"], "config.data_dir is required"),
    (["--config.batch_sise=8"], "batch_sise"),
])
def test_the_command_names_a_missing_or_misspelt_key(argv, message):
  with pytest.raises(SystemExit, match=message):
    cli.main(["train", "--config", "gsm8k_qwen3", *argv])


@pytest.mark.parametrize("storage", ["local", "gs"])
def test_the_model_and_tokenizer_load_from_model_dir(tmp_path, storage):
  """Tunix's Qwen3 loader maps Hugging Face tensors into the model (cast to float32), and the
  tokenizer files load beside them; a gs:// model_dir is read through epath (a bucket double)."""
  root = tmp_path / "bucket_root"
  directory = root / "bucket" / "qwen3"
  directory.mkdir(parents=True)
  tensors = hf_checkpoint(np.random.default_rng(0))
  safetensors.numpy.save_file(tensors, str(directory / "model.safetensors"))
  save_tokenizer(directory)
  config = configs.load("gsm8k_qwen3")
  config.model_dir = "gs://bucket/qwen3" if storage == "gs" else str(directory)
  mesh = gsm8k.make_mesh(config)
  if storage == "gs":
    with gcs_double.serve(str(root)):
      model, tokenizer = gsm8k.load_pretrained(config, mesh, model_config=TINY)
  else:
    model, tokenizer = gsm8k.load_pretrained(config, mesh, model_config=TINY)
  assert tokenizer.decode(tokenizer.encode("#### 1,200")) == "#### 1,200"
  assert tokenizer.eos_id() == tokenizer.encode("<|im_end|>")[0]
  c = TINY

  def loaded(param):
    value = np.asarray(param[...])
    assert value.dtype == np.float32
    return value

  def hf(name):
    return tensors[name].astype(np.float32)

  np.testing.assert_array_equal(loaded(model.embedder.input_embedding),
                                hf("model.embed_tokens.weight"))
  np.testing.assert_array_equal(loaded(model.lm_head.w), hf("lm_head.weight").T)
  np.testing.assert_array_equal(
      loaded(model.layers[0].attn.q_proj.w),
      hf("model.layers.0.self_attn.q_proj.weight").T.reshape(c.embed_dim, c.num_heads,
                                                              c.head_dim))
  np.testing.assert_array_equal(loaded(model.layers[0].mlp.down_proj.kernel),
                                hf("model.layers.0.mlp.down_proj.weight").T)


def test_load_pretrained_names_a_missing_checkpoint(tmp_path):
  config = configs.load("gsm8k_qwen3")
  config.model_dir = str(tmp_path / "absent")
  mesh = gsm8k.make_mesh(config)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    gsm8k.load_pretrained(config, mesh)
  save_tokenizer(tmp_path / "tokenizer_only")
  config.model_dir = str(tmp_path / "tokenizer_only")
  with pytest.raises(FileNotFoundError, match=r"holds no \*.safetensors"):
    gsm8k.load_pretrained(config, mesh)


@pytest.mark.slow
def test_one_sera_step_on_mocked_gsm8k_with_a_tiny_qwen3(tmp_path, mocked_gsm8k, tokenizer):
  """The shipped config shrunk to 4 problems x N0 = 4 and 8 new tokens, generated 8 and
  trained 2 prompts at a time: one real step, one optimizer step, with every decoder layer
  rematerialised as the config's model is."""
  config = configs.load("gsm8k_qwen3")
  config.update(data_dir=str(tmp_path / "tfds"), batch_size=4, baseline_n=4, n_max=8,
                num_steps=1, max_prompt_length=256, max_tokens_to_generate=8,
                kv_cache_size=264, generation_batch_size=8, train_micro_batch_size=2)
  model = qwen3.Qwen3(dataclasses.replace(TINY, remat_config=qwen3.RematConfig.DECODER),
                      rngs=nnx.Rngs(0))
  learner = gsm8k.train(config, model=model, tokenizer=tokenizer)
  assert learner.algo_config.dataset_size == len(PENS)
  assert learner.batches_seen == 1
  assert learner.last_counts.shape == (4,) and learner.last_counts.sum() == 4 * 4
  losses = learner.rl_cluster.actor_trainer.metrics_logger.get_metric_history("actor", "loss",
                                                                              "train")
  assert len(losses) == 1 and np.isfinite(losses).all()
  assert learner.rl_cluster.actor_trainer.train_steps == 1
