"""GSM8K with Qwen3-1.7B on one accelerator of 80 GB: the shipped `gsm8k_qwen3` with its
memory keys sized for one device by benchmarks/llm_memory.py (docs/scaling_llm.md).

  sera-jax train --config gsm8k_qwen3_1device --config.model_dir=DIR --config.data_dir=TFDS_DIR

One device holds the float32 weights, AdamW's moments and the accumulated gradient whole
(26 GiB for Qwen3-1.7B), and a training micro-step's logits grow with its rollouts times their
tokens, so the smallest micro-step of the 8-device config (one prompt x N0 = 16 rollouts of
1280 tokens) needs 124 GiB. This preset trains one prompt x N0 = 8 rollouts of at most
256 + 512 tokens a micro-step, and generates 128 rollouts at a time.
"""

from sera_jax.harness.configs import gsm8k_qwen3


def get_config():
  config = gsm8k_qwen3.get_config()
  config.baseline_n = 8  # N0: B = 8 M rollouts a step
  config.n_max = 32
  config.max_tokens_to_generate = 512
  config.kv_cache_size = 768  # max_prompt_length + max_tokens_to_generate
  config.train_micro_batch_size = 1  # prompts: N0 rollouts a micro-step
  config.generation_batch_size = 128
  config.mesh_shape = (1, 1)
  return config
