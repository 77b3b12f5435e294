"""POLARIS with Qwen3-4B-Base: the SERA authors' third LLM experiment (docs/llm.md, "The
shipped LLM configs"), on the keys of `gsm8k_qwen3`. Sized for 32 devices of 80 GB (the
authors' 4 nodes x 8 GPUs):

  sera-jax train --config polaris_qwen3 --config.model_dir=DIR --config.data_file=TRAIN

DIR (local or gs://) holds Qwen/Qwen3-4B-Base's safetensors and tokenizer files; TRAIN is
POLARIS-Project/Polaris-Dataset-53K's train split (problem, answer; the authors' prepared
Parquet keeps both fields), graded by math-verify.
"""

from sera_jax.harness.configs import gsm8k_qwen3


def get_config():
  config = gsm8k_qwen3.get_config()
  config.model_family = "qwen3"
  config.model_preset = "qwen3_4b_base"  # tied embeddings
  config.data_format = "math"
  # The authors' instruction as their script writes it: the doubled braces of a format
  # string that is never formatted, so the model reads \boxed{{}}.
  config.instruction = "Please reason step by step, and put your final answer within \\boxed{{}}."
  # The chat template's own default, as the authors render it (no thinking-mode override).
  config.enable_thinking = True
  # SERA's M, N0, n_min, n_max and threshold, the estimator's defaults, temperature 1.0 and
  # the mesh are gsm8k_qwen3's, as in the authors' script.
  # verl's AdamW (weight decay 0.01) at a constant 1e-6, gradients clipped to 0.3.
  config.learning_rate = 1e-6
  config.weight_decay = 0.01
  config.grad_clip_norm = 0.3
  config.num_steps = 1000
  config.max_prompt_length = 1024
  config.max_tokens_to_generate = 4096
  config.kv_cache_size = 5120
  # The largest that fit 32 devices of 80 GB with a fifth to spare, by benchmarks/llm_memory.py
  # (docs/scaling_llm.md): 64 rollouts need 52 GiB a device (the KV cache is whole on every
  # device), a micro-step of 2 prompts 48 GiB (4: 94); one prompt's 16 rollouts cannot be
  # split over 32 devices.
  config.generation_batch_size = 64
  config.train_micro_batch_size = 2
  return config
