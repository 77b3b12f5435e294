"""Device memory of an LLM config's training micro-step and sampler, from XLA's analysis of
the compiled steps: what train_micro_batch_size and generation_batch_size a device can hold.

Nothing runs and no weights exist: the config's model (a ModelConfig preset of its Tunix
family, Qwen3, Qwen2 or Llama, with its model_kwargs) is built abstractly
(`nnx.eval_shape`) with the config's dtypes and remat, sharded as Tunix shards it over an
("fsdp", "tp") = (devices, 1) mesh of fake CPU devices (the config's default mesh), and each
step is lowered and compiled for that mesh with abstract inputs at the config's lengths
(the shipped config `gsm8k_qwen3`: prompts of max_prompt_length, completions of
max_tokens_to_generate, a KV cache of kv_cache_size). Per device, XLA's memory analysis gives
the arguments, outputs and temporaries of each executable, and their total less the buffers
outputs reuse of donated arguments:

* train: one micro-step of the actor as Tunix's trainer runs it: SeraLearner's policy loss
  of train_micro_batch_size prompts x N0 rollouts, its gradient and the optimizer update,
  the config's AdamW with gradient clipping inside Tunix's optax.MultiSteps accumulation
  (the optimizer state donated, the parameters not);
* prefill, decode: Tunix's vanilla sampler's prefill of generation_batch_size rollouts and
  its decode loop, with the KV cache the sampler allocates (the model's dtype; created
  outside the jitted steps, so each device holds all of it) and the remat off, as
  SeraLearner generates. Colocated, the actor's optimizer state stays on the devices while
  the sampler runs: the "colocated" column adds it.

Each mesh size runs in its own interpreter (the device count is fixed when JAX starts), whose
compiler is set to keep what an accelerator's keeps (`WORKER_FLAGS`).

  python benchmarks/llm_memory.py    # the config's two keys, both models, 1, 4 and 8 devices
  python benchmarks/llm_memory.py --dtypes float32 --train-micro-batch 1 4 \\
      --generation-batch 64 256        # float32 activations and KV cache, more sizes
  python benchmarks/llm_memory.py --models qwen3_8b --devices 8 --train-micro-batch 2 8
  python benchmarks/llm_memory.py --config gsm8k_qwen3_1device --models qwen3_1p7b \\
      --devices 1 --train-micro-batch 1 --generation-batch 128   # the one-device preset
  python benchmarks/llm_memory.py --config gsm8k_smollm2 --models "" --dtypes float32 \\
      --devices 8 --train-micro-batch 4 --generation-batch 512   # "": the config's own model
"""

import argparse
import contextlib
import functools
import itertools
import json
import time

import memory  # benchmarks/ is the script's directory, so it is on sys.path

# The worker's compiler: machine code is never run, so LLVM's optimisations are skipped (half
# the compile time, the same buffers). XLA's CPU pipeline would otherwise schedule for
# concurrency rather than memory, and expand the optimisation barriers that keep
# jax.checkpoint's recomputation apart early enough for common-subexpression elimination to
# merge it back into the forward pass, keeping every layer's activations (remat undone).
WORKER_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                "--xla_cpu_enable_concurrency_optimized_scheduler=false",
                "--xla_disable_hlo_passes=cse_barrier_expander")
COLUMNS = ("arguments", "outputs", "temporaries", "total", "colocated")


def _model_class(family: str):
  """Tunix's model class of a family of `gsm8k.FAMILIES`."""
  from sera_jax.settings.llm import gsm8k

  module = gsm8k.FAMILIES[family][0]
  return getattr(module, {"qwen3": "Qwen3", "qwen2": "Qwen2", "llama3": "Llama3"}[family])


def _sharded(tree, mesh):
  """Abstract leaves of an nnx state, placed on `mesh` as their sharding annotations say."""
  import jax
  from flax import nnx

  return jax.tree.map(lambda leaf, spec: jax.ShapeDtypeStruct(
      leaf.shape, leaf.dtype, sharding=jax.sharding.NamedSharding(mesh, spec)),
      tree, nnx.get_partition_spec(tree))


def _shard_gib(tree) -> float:
  """GiB of one device's shards of the abstract leaves of `tree`."""
  import jax
  import numpy as np

  return sum(int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
             for leaf in jax.tree.leaves(tree)) / memory.GIB


def _row(config, step: str, key: int, compiled, resident: float) -> dict:
  gib = memory.analysis_gib(compiled)
  return {"model": config.model_preset or config.model_family, "dtype": config.dtype,
          "step": step, "key": key, **gib, "colocated": gib["total"] + resident}


@contextlib.contextmanager
def _activation_constraints(mesh, model_lib):
  """Tunix's models (`model_lib`, the family's module) skip their activation sharding
  constraints on a CPU; this applies them on `mesh`, as on an accelerator."""
  import jax

  skipping = model_lib.shard
  model_lib.shard = lambda x, spec: jax.lax.with_sharding_constraint(
      x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))
  try:
    yield
  finally:
    model_lib.shard = skipping


def measure(config, train_micro_batches: list[int], generation_batches: list[int], *,
            model_config=None) -> list[dict]:
  """Memory rows of an LLM config on a mesh of every device: one train row per
  train_micro_batch_size (prompts), a prefill and a decode row per generation_batch_size
  (rollouts).

  Args:
    config: the keys of the config `gsm8k_qwen3` (the model's family, preset and
      model_kwargs, its dtypes and remat, the lengths, batch and optimizer keys).
    train_micro_batches, generation_batches: the values of those keys to compile.
    model_config: the family's ModelConfig; default `gsm8k.preset_config(config)`.
  """
  from sera_jax.settings.llm import gsm8k

  mesh = gsm8k.make_mesh(config)
  model_config = model_config or gsm8k.preset_config(config)
  with _activation_constraints(mesh, gsm8k.FAMILIES[config.model_family][0]):
    return _measure(config, model_config, mesh, train_micro_batches, generation_batches)


def _measure(config, model_config, mesh, train_micro_batches, generation_batches):
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx
  from tunix.generate import sampler as sampler_lib
  from tunix.rl import common

  from sera_jax.harness.configs import gsm8k_qwen3
  from sera_jax.settings.llm import config as llm_config
  from sera_jax.settings.llm import gsm8k, tiny, tunix_compat
  from sera_jax.settings.llm import learner as learner_lib

  n0, prompt, completion = (config.baseline_n, config.max_prompt_length,
                            config.max_tokens_to_generate)
  algo_config = llm_config.sera_config(config, dataset_size=gsm8k_qwen3.GSM8K_TRAIN)
  algo_config.temperature = config.temperature  # as Tunix's GRPOLearner sets it
  on_fsdp = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))

  def actor(accumulated: int):
    """The actor and Tunix's optimizer of it, accumulating `accumulated` micro-steps."""
    optimizer = optax.MultiSteps(gsm8k.make_optimizer(config), accumulated)
    model = _model_class(config.model_family)(model_config, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optimizer, wrt=nnx.Param)

  def train_step(graph, params, opt_state, example):
    model, optimizer = nnx.merge(graph, params, opt_state)

    def loss(model):
      return learner_lib.budget_norm_loss(model, example, algo_config,
                                          pad_id=tiny.CharTokenizer.PAD,
                                          eos_id=tiny.CharTokenizer.EOS)

    (value, _), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    optimizer.update(model, grads)
    _, params, opt_state = nnx.split((model, optimizer), nnx.Param, ...)
    return value, optax.global_norm(grads), params, opt_state

  def batch(rows: int, length: int | None, dtype):
    return jax.ShapeDtypeStruct((rows,) if length is None else (rows, length), dtype,
                                sharding=on_fsdp)

  rows = []
  for micro in train_micro_batches:
    graph, params, opt_state = nnx.split(
        nnx.eval_shape(lambda micro=micro: actor(config.batch_size // micro)), nnx.Param, ...)
    params, opt_state = _sharded(params, mesh), _sharded(opt_state, mesh)
    size = micro * n0
    example = common.TrainExample(
        prompt_ids=batch(size, prompt, jnp.int32), prompt_mask=batch(size, prompt, jnp.bool_),
        completion_ids=batch(size, completion, jnp.int32),
        completion_mask=batch(size, completion, jnp.int32),
        advantages=batch(size, None, jnp.float32), ref_per_token_logps=None,
        old_per_token_logps=None)
    # Tunix's trainer donates the optimizer's state, not the model's.
    step = jax.jit(functools.partial(train_step, graph), donate_argnums=1)
    rows.append(_row(config, "train", micro,
                     step.lower(params, opt_state, example).compile(), 0.0))

  # The sampler shares the actor's weights (colocated); the actor's optimizer state stays.
  accumulated = config.batch_size // config.train_micro_batch_size
  graph, params, opt_state = nnx.split(nnx.eval_shape(lambda: actor(accumulated)), nnx.Param,
                                       ...)
  params, opt_state = _sharded(params, mesh), _sharded(opt_state, mesh)
  model, _ = nnx.merge(graph, params, opt_state)
  # It reads only the pad id and the stop tokens of a tokenizer, whose values do not change
  # its memory: the tiny task's stands in.
  sampler = sampler_lib.Sampler(model, tiny.CharTokenizer(), sampler_lib.CacheConfig(
      cache_size=config.kv_cache_size, num_layers=model_config.num_layers,
      num_kv_heads=model_config.num_kv_heads, head_dim=model_config.head_dim))
  sampler.eos_ids = jnp.array([tiny.CharTokenizer.EOS])  # what Sampler.__call__ sets for its steps
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  resident = _shard_gib(opt_state)
  for generation in generation_batches:
    with tunix_compat.without_remat(model):
      state = jax.eval_shape(lambda ids: sampler.init_sample_state(
          ids, total_sampling_steps=prompt + completion, include_logits=False,
          forbidden_token_ids=None, temperature=config.temperature, top_p=1.0, top_k=None,
          seed=jax.random.PRNGKey(0), beam_size=None),
          jax.ShapeDtypeStruct((generation, prompt), jnp.int32))
      # Its arrays are made outside the jitted steps, so each device holds them whole; the
      # prompt length is a static field, concrete in the sampler (a tracer under eval_shape).
      state = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                             sharding=replicated),
                           state).replace(num_input_tokens=jnp.array(prompt, jnp.int32))
      weights = sampler._flattened_transformer_state
      prefill = sampler._compiled_prefill_fn.lower(weights, state, None, echo=False).compile()
      # The decode loop starts from the state the prefill leaves, placed as it leaves it.
      state = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(
          leaf.shape, leaf.dtype, sharding=sharding), state, prefill.output_shardings)
      decode = sampler._compiled_decode_fn.lower(weights, state).compile()
    rows.append(_row(config, "prefill", generation, prefill, resident))
    rows.append(_row(config, "decode", generation, decode, resident))
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="gsm8k_qwen3",
                      help="the LLM config whose model, lengths, N0 and optimizer are measured")
  parser.add_argument("--models", nargs="+", default=["qwen3_1p7b", "qwen3_8b"],
                      help="ModelConfig presets of the config's family (\"\": the config's "
                           "own model_preset and model_kwargs)")
  parser.add_argument("--dtypes", nargs="+", default=["bfloat16"],
                      help="the models' dtype (activations, KV cache: the config's bfloat16, "
                           "or float32); weights stay float32 (config.param_dtype)")
  parser.add_argument("--devices", type=int, nargs="+", default=[1, 4, 8])
  parser.add_argument("--train-micro-batch", type=int, nargs="+", default=[4],
                      help="train_micro_batch_size values (prompts, N0 rollouts each)")
  parser.add_argument("--generation-batch", type=int, nargs="+", default=[256],
                      help="generation_batch_size values (rollouts)")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:  # one mesh size, in this interpreter
    from sera_jax.harness import configs
    for model, dtype in itertools.product(args.models, args.dtypes):
      config = configs.load(args.config)
      config.model_preset, config.dtype = model or config.model_preset, dtype
      for row in measure(config, args.train_micro_batch, args.generation_batch):
        print(json.dumps(row), flush=True)
    return
  start = time.perf_counter()
  print(f"{args.config}: GiB per device, XLA's analysis of the compiled steps (not run); "
        "train: train_micro_batch_size prompts; prefill, decode: generation_batch_size "
        "rollouts; colocated: total + the actor's optimizer state")
  print(f"{'devices':>7}  {'model':<11} {'dtype':<8} {'step':<7} {'batch':>5}  "
        + "  ".join(f"{name:>11}" for name in COLUMNS))
  worker_args = ["--config", args.config, "--models", *args.models, "--dtypes", *args.dtypes,
                 "--train-micro-batch", *map(str, args.train_micro_batch), "--generation-batch",
                 *map(str, args.generation_batch)]
  for devices in args.devices:
    for row in memory.worker_rows(__file__, devices, worker_args, WORKER_FLAGS):
      print(f"{devices:>7}  {row['model']:<11} {row['dtype']:<8} {row['step']:<7} "
            f"{row['key']:>5}  " + "  ".join(f"{row[name]:>11.2f}" for name in COLUMNS),
            flush=True)
  print(f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  main()
