"""The benchmark scripts run as documented (smoke tests: no timing is asserted)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))

import alignment_step  # noqa: E402
import memory  # noqa: E402
import run as benchmark_table  # noqa: E402

from sera_jax.harness import configs  # noqa: E402


@pytest.mark.slow
def test_step_ratios_measure_every_step():
  best = alignment_step.measure("mlp", batch=8, rounds=1, repeats=1)
  assert set(best) == {"ce", "alignment", "sera", "gradients"}
  assert all(0 < seconds < 60 for seconds in best.values())


def test_allocator_rows_match_the_reference():
  rows = benchmark_table.allocator_rows(256, repeats=1)
  x64 = next(row for row in rows if row[0].endswith("x64"))
  assert x64[3] is True and "counts identical" in x64[4]


@pytest.mark.slow
def test_memory_compiles_the_three_steps_of_an_imagenet_config():
  """Compile-only memory of a small stand-in (an MLP on 16x16 images) of the ImageNet config."""
  config = configs.load("imagenet_resnet50")
  config.model = "mlp"
  config.dataset_kwargs.image_size = 16
  small, large = memory.measure(config, 4), memory.measure(config, 32)
  assert config.model == "mlp" and config.batch_size == 256  # measured on a copy
  for gib in (small, large):
    assert set(gib) == set(memory.STEPS) and min(gib.values()) > 0
  for step in memory.STEPS:  # activations grow with the per-device batch
    assert large[step] > small[step], step
  with pytest.raises(ValueError, match="give an ImageNet config"):
    memory.measure(configs.load("default"), 2)
