"""The benchmark scripts run as documented (smoke tests: no timing is asserted)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))

import alignment_step  # noqa: E402
import conv_batching  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import llm_memory  # noqa: E402
import memory  # noqa: E402
import run as benchmark_table  # noqa: E402
import sampling_slices  # noqa: E402
import step_parts  # noqa: E402
from tunix.models.qwen3 import model as qwen3  # noqa: E402

from sera_jax.harness import configs  # noqa: E402
from sera_jax.settings.classification import gradients  # noqa: E402
from sera_jax.settings.classification.task import ClassificationTask  # noqa: E402


@pytest.mark.slow
def test_step_ratios_measure_every_step():
  best = alignment_step.measure("mlp", batch=8, rounds=1, repeats=1)
  assert set(best) == {"ce", "alignment", "sera", "gradients"}
  assert all(0 < seconds < 60 for seconds in best.values())


def test_conv_batching_times_three_ways_of_one_convolution():
  """Every way is the convolution (so the table compares like with like)."""
  images = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 8, 32))
  kernel = jax.random.normal(jax.random.PRNGKey(1), (3, 3, 32, 64))
  for way in (conv_batching.patches_times_kernel, conv_batching.one_a_run):
    assert jnp.allclose(way(images, kernel), conv_batching.convolution(images, kernel),
                        rtol=1e-4, atol=1e-3)
  times = conv_batching.measure(runs=2, batch=2, repeats=1)
  assert set(times) == {"convolution", "patches x kernel", "one a run"}
  assert all(seconds > 0 for pair in times.values() for seconds in pair)


@pytest.mark.slow
def test_sampling_slices_times_both_ways_and_restores_the_bound():
  bound = gradients._SLICED_MIN_SLOTS
  rounds = sampling_slices.measure("mlp", runs=2, steps=1, repeats=2)
  assert gradients._SLICED_MIN_SLOTS == bound
  assert set(rounds) == {"in slices", "vmapped"}
  assert all(len(seconds) == 2 and min(seconds) > 0 for seconds in rounds.values())
  # Budget scaling's largest batch of ten: 128 prompts of up to 4096 rollouts a run.
  assert sampling_slices.slots("n0_1024", 10) == 10 * 128 * 4096 > bound


def test_step_parts_times_every_part_both_ways():
  times = step_parts.measure(runs=2, repeats=1)
  assert set(times) == {"forward + 5 backward passes", "the passes' matrix products",
                        "SERA allocation", "SERA allocation + rollouts", "uniform rollouts"}
  assert all(seconds > 0 for pair in times.values() for seconds in pair)


def test_the_matrix_products_part_has_the_products_of_the_passes():
  task = ClassificationTask(configs.load("default"))
  inputs = jax.tree.map(lambda x: x[0], step_parts._inputs(task, 1))
  backward, names = step_parts._parts(task)["forward + 5 backward passes"]
  matmuls, same_names = step_parts._parts(task)["the passes' matrix products"]
  assert same_names == names
  (gradients,) = backward(*(inputs[n] for n in names))
  kernel_gradients = [layer["kernel"] for layer in gradients.values()]
  products = matmuls(*(inputs[n] for n in names))
  # Each of the five cotangents' kernel gradients, as the passes take them.
  assert len(products) == 5 * len(kernel_gradients) == 15
  for stacked in kernel_gradients:
    assert stacked.shape[0] == 5
    assert sum(p.shape == stacked.shape[1:] for p in products) == 5


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


@pytest.mark.slow
def test_llm_memory_compiles_the_train_step_and_the_sampler_of_a_small_qwen3():
  """Compile-only memory of a one-layer Qwen3 (remat on, bfloat16) at the GSM8K config's
  keys shrunk: a train row per micro-batch, a prefill and a decode row per generation batch."""
  config = configs.load("gsm8k_qwen3")
  config.update(batch_size=4, baseline_n=2, train_micro_batch_size=2,
                max_prompt_length=8, max_tokens_to_generate=8, kv_cache_size=16)
  small = qwen3.ModelConfig(num_layers=1, vocab_size=64, embed_dim=32, hidden_dim=64,
                            num_heads=2, head_dim=16, num_kv_heads=1, rope_theta=10_000,
                            norm_eps=1e-6, use_tied_embedding=False, dtype=jnp.bfloat16,
                            remat_config=qwen3.RematConfig.DECODER)
  skipping = qwen3.shard
  rows = llm_memory.measure(config, [1, 2], [4, 8], model_config=small)
  assert qwen3.shard is skipping  # the constraints applied while compiling only
  assert [(row["step"], row["key"]) for row in rows] == [
      ("train", 1), ("train", 2), ("prefill", 4), ("decode", 4), ("prefill", 8), ("decode", 8)]
  for row in rows:
    assert 0 < row["total"] <= row["colocated"]
    assert row["total"] <= row["arguments"] + row["outputs"] + row["temporaries"]
  by_step = {(row["step"], row["key"]): row for row in rows}
  assert by_step["train", 2]["temporaries"] > by_step["train", 1]["temporaries"]
  assert by_step["prefill", 8]["arguments"] > by_step["prefill", 4]["arguments"]  # KV cache
