"""TensorFlow, imported only where it is needed (tfds input pipelines, TensorBoard events).

It is imported with every GPU hidden from it, so that it never reserves memory
that JAX needs.
"""

import functools
import warnings
from types import ModuleType


@functools.cache
def tensorflow() -> ModuleType:
  """The `tensorflow` module, with no GPU visible to it."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  try:
    tf.config.set_visible_devices([], "GPU")
  except RuntimeError:  # TensorFlow already initialised its devices elsewhere.
    if tf.config.get_visible_devices("GPU"):
      warnings.warn("TensorFlow was initialised before sera_jax could hide the GPUs; it "
                    "may reserve GPU memory that JAX needs.", stacklevel=3)
  return tf
