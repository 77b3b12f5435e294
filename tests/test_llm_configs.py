"""The paper's LLM experiments as shipped configs (gsm8k_smollm2, math_qwen25, polaris_qwen3):
the authors' settings, each model's ModelConfig, and (slow) each config proven on this CPU: a
tiny random model of its own family written in Hugging Face format, a few problems in its data
format, one SERA step through the training entry and one `evaluate` run."""

import csv
import dataclasses
import json

import ml_collections
import numpy as np
import pyarrow as pa
import pytest
from pyarrow import parquet
from tiny_hf import TINY, save_checkpoint

from sera_jax.harness import configs
from sera_jax.settings.llm import evaluate, gsm8k

# name -> (model family, preset, M, N0, n_max, learning rate, grad clip, steps, prompt and
# generated tokens, data format): the authors' scripts' values (docs/llm.md).
AUTHORS = {
    "gsm8k_smollm2": ("llama3", "", 256, 16, 64, 1e-5, 1.0, 2000, 512, 2048, "verl"),
    "math_qwen25": ("qwen2", "qwen2p5_math_1p5b", 256, 16, 64, 1e-6, 0.3, 600, 1024, 3000,
                    "simplerl"),
    "polaris_qwen3": ("qwen3", "qwen3_4b_base", 256, 16, 64, 1e-6, 0.3, 1000, 1024, 4096,
                      "math"),
}


@pytest.mark.parametrize("name", sorted(AUTHORS))
def test_a_config_has_the_authors_settings(name):
  config = configs.load(name)
  assert (config.model_family, config.model_preset, config.batch_size, config.baseline_n,
          config.n_max, config.learning_rate, config.grad_clip_norm, config.num_steps,
          config.max_prompt_length, config.max_tokens_to_generate,
          config.data_format) == AUTHORS[name]
  assert (config.method, config.n_min, config.threshold, config.discount, config.alpha0,
          config.beta0) == ("sera", 2, 0.05, 0.75, 0.5, 0.5)
  assert (config.optimizer, config.weight_decay, config.schedule, config.warmup_steps,
          config.temperature) == ("adam", 0.01, "constant", 0, 1.0)
  assert config.kv_cache_size >= config.max_prompt_length + config.max_tokens_to_generate
  assert config.batch_size % config.train_micro_batch_size == 0


@pytest.mark.parametrize("name, sizes", [
    ("gsm8k_smollm2", (32, 960, 2560, 15, 5, 49_152, True)),
    ("math_qwen25", (28, 1536, 8960, 12, 2, 151_936, True)),
    ("polaris_qwen3", (36, 2560, 9728, 32, 8, 151_936, True))])
def test_each_model_is_its_checkpoints_architecture(name, sizes):
  """Layers, width, MLP width, query and key-value heads, vocabulary and tied embeddings of
  SmolLM2-360M, Qwen2.5-Math-1.5B and Qwen3-4B-Base (their config.json)."""
  model = gsm8k.preset_config(configs.load(name))
  tied = getattr(model, "use_tied_embedding", getattr(model, "weight_tying", None))
  assert (model.num_layers, model.embed_dim, model.hidden_dim, model.num_heads,
          model.num_kv_heads, model.vocab_size, tied) == sizes


def test_model_kwargs_are_checked_against_the_family():
  config = configs.load("gsm8k_smollm2")
  config.dtype = "bfloat16"
  with pytest.raises(ValueError, match="llama3 computes in its weights' dtype"):
    gsm8k.preset_config(config)
  config.dtype = "float32"
  config.model_kwargs.num_layers = 2
  assert gsm8k.preset_config(config).num_layers == 2
  config.model_kwargs = ml_collections.ConfigDict({"num_layer": 2})
  with pytest.raises(ValueError, match="has no field num_layer"):
    gsm8k.preset_config(config)
  config.model_kwargs = ml_collections.ConfigDict({"num_layers": 2})
  with pytest.raises(ValueError, match="must give every field"):
    gsm8k.preset_config(config)


def test_a_math_graded_file_needs_a_grader(tmp_path):
  config = configs.load("polaris_qwen3")
  config.update(model_dir=str(tmp_path), data_file=_problem_file(tmp_path, "math", ".jsonl"))
  with pytest.raises(ValueError, match="graded by math-verify: pass a grading.MathGrader"):
    gsm8k.build_learner(config, None)


# ---- each config on a tiny model of its family --------------------------------------------

# (question, reference) pairs; a tiny random model is right by chance at most.
PROBLEMS = [("What is 2 + 3?", "5"), ("What is 1/2 + 1/4?", "\\frac{3}{4}"),
            ("What is 7 * 6?", "42"), ("Solve x - 4 = 0.", "4")]


def _records(format_name: str) -> list[dict]:
  """PROBLEMS as a file of `format_name` holds them."""
  rows = []
  for index, (question, answer) in enumerate(PROBLEMS):
    rows.append({
        "verl": {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": question}],
                 "reward_model": {"style": "rule", "ground_truth": answer},
                 "extra_info": {"split": "train", "index": index, "question": question,
                                "answer": f"... #### {answer}"}},
        "simplerl": {"data_source": "simplelr_qwen", "extra_info": {
            "index": index, "question": question, "answer": answer}},
        "math": {"problem": question, "answer": answer, "level": 3},
        "minerva": {"question": question, "answer": answer},
    }[format_name])
  return rows


def _problem_file(directory, format_name: str, suffix: str) -> str:
  path = directory / f"{format_name}{suffix}"
  records = _records(format_name)
  if suffix == ".parquet":
    parquet.write_table(pa.Table.from_pylist(records), str(path))
  else:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
  return str(path)


# name -> (training file's suffix, the benchmark's format and suffix, the checkpoint's EOS)
CASES = {"gsm8k_smollm2": (".parquet", "verl", ".parquet", "<|im_end|>"),
         "math_qwen25": (".parquet", "math", ".jsonl", "<|endoftext|>"),
         "polaris_qwen3": (".jsonl", "minerva", ".jsonl", "<|endoftext|>")}


def _tiny_config(name: str, tmp_path) -> ml_collections.ConfigDict:
  """The shipped config `name` on a tiny random model of its family (tied as the real one),
  shrunk to 4 prompts x N0 = 2 rollouts of at most 8 tokens."""
  config = configs.load(name)
  train_suffix, _, _, eos = CASES[name]
  tiny = dataclasses.replace(TINY[config.model_family], **{
      "llama3": {"weight_tying": True}}.get(config.model_family, {"use_tied_embedding": True}))
  model_dir = tmp_path / "model"
  model_dir.mkdir()
  save_checkpoint(model_dir, config.model_family, tiny, eos_token=eos)
  fields = {field.name: getattr(tiny, field.name) for field in dataclasses.fields(tiny)
            if field.name not in ("shd_config", "remat_config", "dtype", "param_dtype")}
  config.model_kwargs = ml_collections.ConfigDict(fields)
  config.update(model_dir=str(model_dir), model_preset="",
                data_file=_problem_file(tmp_path, config.data_format, train_suffix),
                grading_processes=1, batch_size=4, baseline_n=2, n_min=2, n_max=4,
                num_steps=1, max_prompt_length=160, max_tokens_to_generate=8,
                kv_cache_size=168, generation_batch_size=8, train_micro_batch_size=2)
  return config


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_config_trains_a_sera_step_and_evaluates_on_a_tiny_model_of_its_family(name,
                                                                                  tmp_path):
  config = _tiny_config(name, tmp_path)
  learner = gsm8k.train(config)
  assert learner.rl_cluster.actor_trainer.train_steps == 1
  assert learner.algo_config.dataset_size == len(PROBLEMS)
  _, benchmark_format, suffix, _ = CASES[name]
  benchmark = evaluate.Benchmark("bench", benchmark_format,
                                 _problem_file(tmp_path, benchmark_format, suffix))
  # No greedy completion: another sampler to compile (tests/test_evaluate.py scores one).
  rows = evaluate.evaluate(config, [benchmark], tmp_path / "eval", samples=2, greedy=False,
                           grading_processes=1)
  (row,) = rows
  assert (row["problems"], row["samples"], row["grading_failures"]) == (4, 2, 0)
  with open(tmp_path / "eval" / evaluate.CSV) as stream:
    (written,) = list(csv.DictReader(stream))
  samples = [json.loads(line) for line in (tmp_path / "eval" / evaluate.SAMPLES).open()]
  assert [(s["problem"], s["reference"]) for s in samples] == [
      (i, answer) for i, (_, answer) in enumerate(PROBLEMS) for _ in range(2)]
  correct = np.array([s["correct"] for s in samples]).reshape(4, 2)
  assert float(written["mean@2"]) == pytest.approx(correct.mean())
