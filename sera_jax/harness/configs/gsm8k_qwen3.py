"""GSM8K with a pretrained Qwen3 through Tunix (docs/method.md#llm-post-training): the paper's
LLM setting, 256 prompts x N0 = 16 rollouts a step. Sized for an accelerator host, not a CPU:

  sera-jax train --config gsm8k_qwen3 --config.model_dir=DIR --config.data_dir=TFDS_DIR

DIR (local or gs://) holds the model's Hugging Face safetensors checkpoint and tokenizer
files, TFDS_DIR gsm8k prepared by `tfds build gsm8k --data_dir=TFDS_DIR`; nothing is
downloaded. `sera_jax.settings.llm.gsm8k` trains it (the [llm] extra).
"""

import ml_collections

from sera_jax.method import success

GSM8K_TRAIN = 7_473  # problems in tfds gsm8k's train split


def get_config():
  config = ml_collections.ConfigDict()
  config.task = "gsm8k"
  # Model: a Tunix ModelConfig preset of the family, weights and tokenizer from model_dir.
  config.model_family = "qwen3"  # qwen3 | qwen2 | llama3
  config.model_preset = "qwen3_1p7b"  # a ModelConfig classmethod, e.g. qwen3_4b, qwen2p5_1p5b
  config.model_dir = ""  # required: local or gs:// dir of *.safetensors + tokenizer files
  config.model_kwargs = ml_collections.ConfigDict()  # ModelConfig fields over the preset
  config.param_dtype = "float32"  # trained weights: AdamW steps of 1e-6 vanish in bfloat16
  config.dtype = "bfloat16"  # activations
  config.remat = "decoder"  # none | block | decoder: recompute activations in the backward
  # Data: tfds gsm8k, prepared beforehand in data_dir (may be gs://), or a problem file.
  config.data_dir = ""  # required unless data_file is set
  config.data_file = ""  # a .parquet/.jsonl problem file (sera_jax.settings.llm.data) instead
  config.data_format = "gsm8k"  # its format: a key of data.FORMATS (gsm8k, math, verl, ...)
  config.grading_processes = 8  # math-verify's worker processes (a math-graded data_file)
  config.instruction = ""  # after each question; "" = its grader's (data.INSTRUCTIONS)
  config.seed = 0  # the order of the problems, epoch by epoch
  config.enable_thinking = False  # passed to the chat template (Qwen3's thinking mode)
  # Method and SERA (docs/method.md#the-estimator-and-its-scale): M = batch_size prompts a
  # step, budget B = M * N0 rollouts.
  config.method = "sera"  # a mode of SeraConfig.allocation, e.g. sera, uniform, equalized
  config.estimator = "maxrl"  # any registered name (sera_jax.method.estimators)
  config.estimator_kwargs = ml_collections.ConfigDict()  # its parameters: k (pkpo), order
  config.batch_size = 256
  config.baseline_n = 16  # N0
  config.n_min = 2
  config.n_max = 64
  config.threshold = 0.05
  config.normalize_by_rollout_count = True
  config.normalize_by_rho = False
  # Historical success estimator (docs/method.md#estimating-p): the method's defaults.
  config.discount = success.DISCOUNT
  config.alpha0 = success.ALPHA0
  config.beta0 = success.BETA0
  # Optimisation (sera_jax.common.optim): AdamW at a constant 1e-6, gradients clipped.
  config.optimizer = "adam"  # AdamW with weight_decay
  config.learning_rate = 1e-6
  config.weight_decay = 0.0
  config.schedule = "constant"  # constant | cosine
  config.warmup_steps = 0
  config.grad_clip_norm = 1.0
  config.num_steps = 10 * (GSM8K_TRAIN // config.batch_size)  # optimizer steps: 10 epochs
  # Generation (Tunix's vanilla sampler).
  config.max_prompt_length = 256  # tokens; a longer prompt fails when the data loads
  config.max_tokens_to_generate = 1024
  config.kv_cache_size = 1280  # >= max_prompt_length + max_tokens_to_generate
  config.temperature = 1.0
  # Stop tokens besides the tokenizer's EOS, each one token of the vocabulary: Qwen's chat
  # models end a turn with <|im_end|>, a base checkpoint's EOS (and every Qwen's pad) is
  # <|endoftext|>; Qwen3's generation config stops at both. SeraLearner trains whichever one
  # each rollout sampled (docs/llm.md, "Stop tokens").
  config.stop_tokens = ("<|im_end|>", "<|endoftext|>")
  # "" pads with the tokenizer's own pad token (Qwen's <|endoftext|>, which no prompt holds).
  config.pad_token = ""
  config.rollout_seed = 0  # each generation its own key
  # Memory: the budget B = 4096 rollouts is generated generation_batch_size at a time (the
  # KV cache, whole on every device) and trained train_micro_batch_size prompts' rollouts at
  # a time (gradients accumulate to one optimizer step a batch). The largest that fit
  # Qwen3-1.7B on 8 devices of 80 GB with a fifth to spare, as benchmarks/llm_memory.py
  # measures them (docs/scaling_llm.md): 256 rollouts need 49 GiB a device (512: 93), a
  # micro-step of 4 prompts 47 GiB (8: 91). Qwen3-8B there: 128 and 1.
  config.generation_batch_size = 256
  config.train_micro_batch_size = 4
  # Devices, checkpoints, metrics.
  config.mesh_shape = (-1, 1)  # (fsdp, tp); -1: every device not used by tp
  config.checkpoint_dir = ""  # Tunix checkpoints and the SERA estimator; resumed when present
  config.checkpoint_every = 50
  config.checkpoints_to_keep = 2
  config.log_dir = ""  # TensorBoard events of Tunix's metrics
  config.lock()
  return config
