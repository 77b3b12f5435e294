"""A tiny random Qwen3 as a Hugging Face checkpoint, and a byte-level tokenizer with Qwen's
special tokens: what `gsm8k.load_pretrained` reads from a model_dir, written offline."""

import ml_dtypes
import numpy as np
import tokenizers
import transformers
from tokenizers import decoders, pre_tokenizers
from tunix.models.qwen3 import model as qwen3

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # Qwen's pad, turn start, EOS
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TINY = qwen3.ModelConfig(num_layers=1, vocab_size=256 + len(SPECIAL_TOKENS), embed_dim=32,
                         hidden_dim=64, num_heads=2, head_dim=16, num_kv_heads=1,
                         rope_theta=10_000, norm_eps=1e-6, use_tied_embedding=False)


def byte_vocabulary() -> dict[str, int]:
  """The byte-level BPE's tokens (one a byte) and their ids; the special tokens follow."""
  return {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}


def save_tokenizer(directory, eos_token: str = "<|im_end|>") -> None:
  """A byte-level BPE (every byte a token, no merges) with Qwen's special tokens and a ChatML
  template, saved as Hugging Face tokenizer files: any text encodes, offline. A base
  checkpoint's tokenizer has eos_token "<|endoftext|>", its pad too."""
  backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=byte_vocabulary(), merges=[]))
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  backend.decoder = decoders.ByteLevel()
  backend.add_special_tokens(list(SPECIAL_TOKENS))
  tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend,
                                                   pad_token="<|endoftext|>",
                                                   eos_token=eos_token)
  tokenizer.chat_template = CHATML
  tokenizer.save_pretrained(str(directory))


def hf_checkpoint(rng: np.random.Generator) -> dict[str, np.ndarray]:
  """Random bfloat16 tensors of TINY under Hugging Face's Qwen3 names and layouts."""
  c = TINY
  shapes = {"model.embed_tokens.weight": (c.vocab_size, c.embed_dim),
            "model.norm.weight": (c.embed_dim,),
            "lm_head.weight": (c.vocab_size, c.embed_dim)}
  layer = "model.layers.0."
  shapes |= {layer + "self_attn.q_proj.weight": (c.num_heads * c.head_dim, c.embed_dim),
             layer + "self_attn.k_proj.weight": (c.num_kv_heads * c.head_dim, c.embed_dim),
             layer + "self_attn.v_proj.weight": (c.num_kv_heads * c.head_dim, c.embed_dim),
             layer + "self_attn.o_proj.weight": (c.embed_dim, c.num_heads * c.head_dim),
             layer + "self_attn.q_norm.weight": (c.head_dim,),
             layer + "self_attn.k_norm.weight": (c.head_dim,),
             layer + "mlp.gate_proj.weight": (c.hidden_dim, c.embed_dim),
             layer + "mlp.up_proj.weight": (c.hidden_dim, c.embed_dim),
             layer + "mlp.down_proj.weight": (c.embed_dim, c.hidden_dim),
             layer + "input_layernorm.weight": (c.embed_dim,),
             layer + "post_attention_layernorm.weight": (c.embed_dim,)}
  return {name: rng.normal(size=shape).astype(ml_dtypes.bfloat16)
          for name, shape in shapes.items()}
