"""Device memory of a config's training steps, from XLA's analysis of the compiled steps.

Nothing runs and no data is read: the cross-entropy, SERA and alignment steps of a
classification config (default: the paper's ImageNet protocol, ResNet-50 at 224x224,
N0 = 128, n_max = 512, float32) are compiled for a mesh of fake CPU devices with abstract
inputs, and each executable's memory analysis gives the bytes one device holds:
arguments + outputs + temporaries - donated aliases. Each mesh size runs in its own
interpreter (the device count is fixed when JAX starts).

  python benchmarks/memory.py                                   # 1 device, batches 32..256
  python benchmarks/memory.py --devices 8 --per-device-batch 32 # a 256-prompt step on 8

Read a row as: a device holding `per-device batch` prompts of the global batch needs about
this much memory for that step (the allocation is global but works on M floats).
"""

import argparse
import json
import os
import subprocess
import sys
import time

GIB = 2.0**30
IMAGENET_CLASSES = 1000
STEPS = ("ce", "sera", "align")


def analysis_gib(compiled) -> dict[str, float]:
  """GiB one device holds for a compiled executable, from XLA's memory analysis: its
  arguments, outputs and temporaries, and their total less what outputs reuse of donated
  arguments."""
  analysis = compiled.memory_analysis()
  parts = {"arguments": analysis.argument_size_in_bytes,
           "outputs": analysis.output_size_in_bytes,
           "temporaries": analysis.temp_size_in_bytes}
  total = sum(parts.values()) - analysis.alias_size_in_bytes
  return {name: size / GIB for name, size in parts.items()} | {"total": total / GIB}


def worker_rows(script: str, devices: int, args: list[str],
                xla_flags: tuple[str, ...] = ()) -> list[dict]:
  """The JSON rows `script --worker ARGS` prints, run in an interpreter of its own on
  `devices` fake CPU devices (the device count is fixed when JAX starts)."""
  flags = [os.environ.get("XLA_FLAGS", ""),
           f"--xla_force_host_platform_device_count={devices}", *xla_flags]
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags).strip())
  worker = subprocess.run([sys.executable, script, "--worker", *args], env=env,
                          capture_output=True, text=True)
  if worker.returncode:
    raise SystemExit(worker.stderr[-3000:])
  return [json.loads(line) for line in worker.stdout.splitlines()]


def measure(config, per_device_batch: int) -> dict[str, float]:
  """GiB per device of each step of an ImageNet `config` at `per_device_batch` prompts a device.

  Args:
    config: a classification config on imagenet2012 (it is copied, not changed).
    per_device_batch: prompts of the global batch each device of the mesh holds.
  """
  import jax

  from sera_jax.common import sharding
  from sera_jax.common.models import create_model
  from sera_jax.common.optim import make_optimizer
  from sera_jax.settings.classification import task as classification

  mesh = sharding.make_mesh()
  config = config.copy_and_resolve_references()
  config.batch_size = per_device_batch * mesh.size
  if config.dataset.split(":")[0].split("/")[0] != "imagenet2012":
    raise ValueError(f"the config trains on {config.dataset}; give an ImageNet config.")
  size = config.dataset_kwargs.get("image_size") or 224
  image_shape = (size, size, 3)
  model = create_model(config.model, num_classes=IMAGENET_CLASSES, input_shape=image_shape,
                       **config.get("model_kwargs", {}))
  optimizer = make_optimizer(config)

  def on(shape, dtype, placement):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=placement)

  replicated, rows = sharding.replicated(mesh), sharding.data_sharding(mesh)
  state = jax.tree.map(lambda leaf: on(leaf.shape, leaf.dtype, replicated),
                       jax.eval_shape(lambda key: classification.init_train_state(
                           model, optimizer, key), jax.random.PRNGKey(0)))
  images = on((config.batch_size, *image_shape), jax.numpy.float32, rows)
  labels = on((config.batch_size,), jax.numpy.int32, rows)
  gib = {}
  for name in STEPS:
    config.method = "ce" if name == "ce" else "sera"
    step = classification.make_train_step(model, optimizer, config, align=name == "align",
                                          mesh=mesh)
    gib[name] = analysis_gib(step.lower(state, images, labels, 0).compile())["total"]
  return gib


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="imagenet_resnet50")
  parser.add_argument("--devices", type=int, nargs="+", default=[1])
  parser.add_argument("--per-device-batch", type=int, nargs="+", default=[32, 64, 128, 256])
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:  # one mesh size, in this interpreter
    from sera_jax.harness import configs
    config = configs.load(args.config)
    for batch in args.per_device_batch:
      print(json.dumps({"batch": batch} | measure(config, batch)), flush=True)
    return
  start = time.perf_counter()
  print(f"{args.config}: GiB per device, XLA compiled memory analysis (not run)")
  print(f"{'devices':>7}  {'per-device batch':>16}  {'global batch':>12}  "
        + "  ".join(f"{name + ' step':>10}" for name in STEPS) + "  align / ce")
  for devices in args.devices:
    for row in worker_rows(__file__, devices, ["--config", args.config, "--per-device-batch",
                                               *map(str, args.per_device_batch)]):
      print(f"{devices:>7}  {row['batch']:>16}  {row['batch'] * devices:>12}  "
            + "  ".join(f"{row[name]:>10.2f}" for name in STEPS)
            + f"  {row['align'] / row['ce']:>9.2f}x", flush=True)
  print(f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  main()
