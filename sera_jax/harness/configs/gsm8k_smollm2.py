"""GSM8K with SmolLM2-360M-Instruct: the SERA authors' first LLM experiment (docs/llm.md,
"The shipped LLM configs"), on the keys of `gsm8k_qwen3`. Sized for 8 devices of 80 GB:

  sera-jax train --config gsm8k_smollm2 --config.model_dir=DIR --config.data_file=TRAIN

DIR (local or gs://) holds HuggingFaceTB/SmolLM2-360M-Instruct's safetensors and tokenizer
files; TRAIN is openai/gsm8k main's train split as the authors prepare it, a verl Parquet file
(extra_info.question, reward_model.ground_truth: the number after "####"), graded by
math-verify as theirs is. `--config.data_file= --config.data_dir=TFDS_DIR` reads tfds gsm8k
instead, graded by the last number.
"""

import ml_collections

from sera_jax.harness.configs import gsm8k_qwen3


def get_config():
  config = gsm8k_qwen3.get_config()
  # SmolLM2 is a Llama (Tunix's llama3 family, plain RoPE) with tied embeddings; Tunix has no
  # preset of it, so every ModelConfig field is given (its Hugging Face config.json).
  config.model_family = "llama3"
  config.model_preset = ""
  config.model_kwargs = ml_collections.ConfigDict(dict(
      num_layers=32, vocab_size=49_152, embed_dim=960, hidden_dim=2560, num_heads=15,
      head_dim=64, num_kv_heads=5, rope_theta=100_000, norm_eps=1e-5, weight_tying=True))
  # Tunix's Llama computes in its weights' dtype: float32 throughout (the authors' FSDP
  # actor keeps float32 weights and computes in bfloat16).
  config.dtype = "float32"
  config.data_format = "verl"
  # The authors' words after each question (theirs joined by a space, ours by a newline).
  config.instruction = "Let's think step by step and output the final answer within \\boxed{}."
  # SERA's M, N0, n_min, n_max and threshold, the estimator's defaults, temperature 1.0 and
  # the mesh are gsm8k_qwen3's, as in the authors' script.
  # verl's AdamW (weight decay 0.01) at a constant 1e-5, gradients clipped to 1.0.
  config.learning_rate = 1e-5
  config.weight_decay = 0.01
  config.grad_clip_norm = 1.0
  config.num_steps = 2000
  config.max_prompt_length = 512
  config.max_tokens_to_generate = 2048
  config.kv_cache_size = 2560
  # SmolLM2-Instruct's EOS is <|im_end|>, which ends its turn.
  config.stop_tokens = ("<|im_end|>",)
  # Padded with <|endoftext|>, which no prompt holds: a tokenizer that pads with its EOS,
  # <|im_end|>, would have the sampler and the loss mask every end of turn of the chat
  # template out of the prompts (data.problems refuses such prompts).
  config.pad_token = "<|endoftext|>"
  # The largest that fit 8 devices of 80 GB with a fifth to spare, by benchmarks/llm_memory.py
  # (docs/scaling_llm.md): 128 rollouts need 31 GiB a device (256: 62; the float32 KV cache
  # is whole on every device), a micro-step of 2 prompts 32 GiB (4: 63).
  config.generation_batch_size = 128
  config.train_micro_batch_size = 2
  return config
