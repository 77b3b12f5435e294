"""MATH levels 3-5 with Qwen2.5-Math-1.5B: the SERA authors' second LLM experiment
(docs/llm.md, "The shipped LLM configs"), on the keys of `gsm8k_qwen3`. Sized for 8 devices
of 80 GB:

  sera-jax train --config math_qwen25 --config.model_dir=DIR --config.data_file=TRAIN

DIR (local or gs://) holds Qwen/Qwen2.5-Math-1.5B's safetensors and tokenizer files; TRAIN is
the authors' data/math35/train.parquet, MATH levels 3-5 of hkust-nlp/SimpleRL-Zoo-Data
(extra_info.question, extra_info.answer), graded by math-verify.
"""

from sera_jax.harness.configs import gsm8k_qwen3


def get_config():
  config = gsm8k_qwen3.get_config()
  # Tunix's preset: 28 layers, tied embeddings, RoPE theta 10,000 (not Qwen2.5's 1e6).
  config.model_family = "qwen2"
  config.model_preset = "qwen2p5_math_1p5b"
  config.data_format = "simplerl"
  config.instruction = ""  # math's: "Please reason step by step, and put your final ..."
  # SERA's M, N0, n_min, n_max and threshold, the estimator's defaults, temperature 1.0 and
  # the mesh are gsm8k_qwen3's, as in the authors' script.
  # verl's AdamW (weight decay 0.01) at a constant 1e-6, gradients clipped to 0.3.
  config.learning_rate = 1e-6
  config.weight_decay = 0.01
  config.grad_clip_norm = 0.3
  config.num_steps = 600
  config.max_prompt_length = 1024
  config.max_tokens_to_generate = 3000
  config.kv_cache_size = 4024
  # The largest that fit 8 devices of 80 GB with a fifth to spare, by benchmarks/llm_memory.py
  # (docs/scaling_llm.md): 256 rollouts need 55 GiB a device (512: 106), a micro-step of one
  # prompt 35 GiB (2: 67).
  config.generation_batch_size = 256
  config.train_micro_batch_size = 1
  return config
