"""Tiny random checkpoints in Hugging Face format for each Tunix family the LLM configs use
(qwen3, qwen2, llama3), and a byte-level tokenizer with the families' chat tokens: what
`gsm8k.load_pretrained` reads from a model_dir, written offline.

Qwen and SmolLM2 (a Llama) share the ChatML special tokens <|endoftext|>, <|im_start|> and
<|im_end|>; a family's checkpoint differs in its tensors: Qwen3 normalises queries and keys
(q_norm, k_norm), Qwen2 adds biases to them and to the values, Llama has neither.
"""

import json

import ml_dtypes
import numpy as np
import safetensors.numpy
import tokenizers
import transformers
from tokenizers import decoders, pre_tokenizers
from tunix.models.llama3 import model as llama3
from tunix.models.qwen2 import model as qwen2
from tunix.models.qwen3 import model as qwen3

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # pad, turn start, turn end
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VOCAB = 256 + len(SPECIAL_TOKENS)
_DIMS = dict(num_layers=1, vocab_size=VOCAB, embed_dim=32, hidden_dim=64, num_heads=2,
             head_dim=16, num_kv_heads=1, rope_theta=10_000, norm_eps=1e-6)
# Each family's tiny ModelConfig, its embedding untied (a test ties it with dataclasses.replace).
TINY = {"qwen3": qwen3.ModelConfig(**_DIMS, use_tied_embedding=False),
        "qwen2": qwen2.ModelConfig(**_DIMS, use_tied_embedding=False),
        "llama3": llama3.ModelConfig(**_DIMS, weight_tying=False)}
# Hugging Face's architecture of each family, for config.json.
ARCHITECTURES = {"qwen3": ("Qwen3ForCausalLM", "qwen3"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                 "llama3": ("LlamaForCausalLM", "llama")}


def byte_vocabulary() -> dict[str, int]:
  """The byte-level BPE's tokens (one a byte) and their ids; the special tokens follow."""
  return {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}


def save_tokenizer(directory, eos_token: str = "<|im_end|>",
                   pad_token: str = "<|endoftext|>") -> None:
  """A byte-level BPE (every byte a token, no merges) with the ChatML special tokens and
  template, saved as Hugging Face tokenizer files: any text encodes, offline. An instruct
  model's eos_token is "<|im_end|>" (SmolLM2-Instruct's, Qwen's chat models'), a Qwen base
  checkpoint's "<|endoftext|>"; the pad is Qwen's "<|endoftext|>" unless `pad_token` says
  otherwise (a tokenizer may pad with its EOS)."""
  backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=byte_vocabulary(), merges=[]))
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  backend.decoder = decoders.ByteLevel()
  backend.add_special_tokens(list(SPECIAL_TOKENS))
  tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend,
                                                   pad_token=pad_token,
                                                   eos_token=eos_token)
  tokenizer.chat_template = CHATML
  tokenizer.save_pretrained(str(directory))


def tied(config) -> bool:
  """Whether a ModelConfig of any family ties its output layer to the embedding."""
  return getattr(config, "use_tied_embedding", getattr(config, "weight_tying", False))


def hf_checkpoint(family: str, rng: np.random.Generator, config=None) -> dict[str, np.ndarray]:
  """Random bfloat16 tensors of `config` (default TINY[family]) under Hugging Face's names and
  layouts of the family; no lm_head when the config ties it to the embedding."""
  c = config or TINY[family]
  shapes = {"model.embed_tokens.weight": (c.vocab_size, c.embed_dim),
            "model.norm.weight": (c.embed_dim,)}
  if not tied(c):
    shapes["lm_head.weight"] = (c.vocab_size, c.embed_dim)
  q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  for i in range(c.num_layers):
    layer = f"model.layers.{i}."
    shapes |= {layer + "self_attn.q_proj.weight": (q, c.embed_dim),
               layer + "self_attn.k_proj.weight": (kv, c.embed_dim),
               layer + "self_attn.v_proj.weight": (kv, c.embed_dim),
               layer + "self_attn.o_proj.weight": (c.embed_dim, q)}
    if family == "qwen3":
      shapes |= {layer + "self_attn.q_norm.weight": (c.head_dim,),
                 layer + "self_attn.k_norm.weight": (c.head_dim,)}
    if family == "qwen2":
      shapes |= {layer + "self_attn.q_proj.bias": (q,), layer + "self_attn.k_proj.bias": (kv,),
                 layer + "self_attn.v_proj.bias": (kv,)}
    shapes |= {layer + "mlp.gate_proj.weight": (c.hidden_dim, c.embed_dim),
               layer + "mlp.up_proj.weight": (c.hidden_dim, c.embed_dim),
               layer + "mlp.down_proj.weight": (c.embed_dim, c.hidden_dim),
               layer + "input_layernorm.weight": (c.embed_dim,),
               layer + "post_attention_layernorm.weight": (c.embed_dim,)}
  return {name: rng.normal(size=shape).astype(ml_dtypes.bfloat16)
          for name, shape in shapes.items()}


def save_checkpoint(directory, family: str, config, *, eos_token: str = "<|im_end|>",
                    seed: int = 0) -> dict[str, np.ndarray]:
  """A whole Hugging Face model directory of `config`: model.safetensors, config.json and the
  tokenizer files; returns the tensors."""
  tensors = hf_checkpoint(family, np.random.default_rng(seed), config)
  safetensors.numpy.save_file(tensors, str(directory / "model.safetensors"))
  architecture, model_type = ARCHITECTURES[family]
  (directory / "config.json").write_text(json.dumps({
      "architectures": [architecture], "model_type": model_type,
      "num_hidden_layers": config.num_layers, "vocab_size": config.vocab_size,
      "hidden_size": config.embed_dim, "intermediate_size": config.hidden_dim,
      "num_attention_heads": config.num_heads, "head_dim": config.head_dim,
      "num_key_value_heads": config.num_kv_heads, "rope_theta": config.rope_theta,
      "rms_norm_eps": config.norm_eps, "tie_word_embeddings": tied(config),
      "torch_dtype": "bfloat16"}, indent=2))
  save_tokenizer(directory, eos_token=eos_token)
  return tensors
