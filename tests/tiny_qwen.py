"""A tiny random Qwen3 as a Hugging Face checkpoint, and a byte-level tokenizer with Qwen's
special tokens: `tiny_hf`'s for the qwen3 family."""

import numpy as np
from tiny_hf import CHATML, SPECIAL_TOKENS, byte_vocabulary, save_tokenizer  # noqa: F401
from tiny_hf import TINY as TINY_FAMILIES
from tiny_hf import hf_checkpoint as family_checkpoint

TINY = TINY_FAMILIES["qwen3"]


def hf_checkpoint(rng: np.random.Generator) -> dict[str, np.ndarray]:
  """Random bfloat16 tensors of TINY under Hugging Face's Qwen3 names and layouts."""
  return family_checkpoint("qwen3", rng)
