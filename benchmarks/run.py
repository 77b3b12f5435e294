"""The scale-out benchmark table, every ratio measured side by side in this process.

  python benchmarks/run.py [--models mlp resnet18 resnet50] [--batch 16] [--mlp-batch 64]
                          [--sizes 256 4096 65536]

Rows:
  align / ce, sera / ce   an alignment step (five cotangents of one forward pass) and a SERA
                          training step over a cross-entropy step, same model, batch and
                          optimizer, timed interleaved (`alignment_step.measure`); the
                          note gives the floor: the five gradients and their Gram
                          matrix without any SERA work.
  allocate speed-up       the NumPy float64 reference of sera_jax.verification over jitted
                          `allocate(mode="sera")` (N0 = 16, n_min = 2, n_max = 64,
                          p ~ Beta(0.3, 1.5)), in float32 and in x64; the counts of the
                          x64 run must equal the reference's exactly.
  memory/device           the ImageNet config's cross-entropy, SERA and alignment steps
                          (ResNet-50 at 224x224, N0 = 128, n_max = 512, --memory-batch
                          prompts a device): XLA's analysis of the compiled steps
                          (arguments + outputs + temporaries - donated aliases), see
                          benchmarks/memory.py; nothing is run.

Wall times depend on the machine and its load; ratios measured side by side much less.
"""

import argparse
import functools
import time

import alignment_step  # benchmarks/ is the script's directory, so it is on sys.path
import jax
import memory
import numpy as np

from sera_jax.harness import configs
from sera_jax.harness.configs.base import classification as base_config
from sera_jax.method import allocation
from sera_jax.verification import reference

ALLOCATOR = {"baseline_n": 16, "n_min": 2, "n_max": 64}
SPEED_UP_TARGETS = {4096: 5, 65536: 1}  # M -> least jitted speed-up over NumPy


def _best_seconds(fn, repeats: int) -> float:
  best = np.inf
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - start)
  return best


def allocator_rows(num_prompts: int, repeats: int) -> list[tuple[str, str, str, bool | None]]:
  """Reference time over jitted allocate time, float32 and x64; x64 counts must match."""
  rng = np.random.default_rng(num_prompts)
  p = rng.beta(0.3, 1.5, num_prompts)
  log_p = np.log(np.maximum(p, np.finfo(np.float64).tiny))
  want = reference.allocate(log_p, mode="sera", **ALLOCATOR)
  reference_s = _best_seconds(lambda: reference.allocate(log_p, mode="sera", **ALLOCATOR),
                              repeats)
  minimum = SPEED_UP_TARGETS.get(num_prompts)
  target = f">= {minimum}x" if minimum else ""
  rows = []
  for name, x64 in (("float32", False), ("x64", True)):
    with jax.enable_x64(x64):
      fn = jax.jit(functools.partial(allocation.allocate, mode="sera", **ALLOCATOR))
      device_log_p = jax.device_put(log_p.astype(np.float64 if x64 else np.float32))
      counts = np.asarray(fn(device_log_p).counts)  # compiles
      seconds = _best_seconds(lambda: fn(device_log_p).counts.block_until_ready(), repeats)  # noqa: B023
    same = bool(np.array_equal(counts, want.counts))
    note = f"counts {'identical' if same else 'DIFFER'}; NumPy {reference_s * 1e3:.1f} ms"
    if minimum is None:  # no speed target: x64 must still match the reference
      ok = same if x64 else None
    else:
      ok = reference_s / seconds >= minimum and (same or not x64)
    rows.append((f"allocate speed-up M={num_prompts} {name}",
                 f"{reference_s / seconds:.1f}x", target, ok, note))
  return rows


def memory_rows(per_device_batch: int) -> list[tuple[str, str, str, bool | None, str]]:
  """Memory per device of the ImageNet config's steps (compiled here, not run)."""
  gib = memory.measure(configs.load("imagenet_resnet50"), per_device_batch)
  note = (f"ResNet-50 224x224, {per_device_batch} prompts a device x {jax.device_count()} "
          f"device(s), N0 = 128, n_max = 512; XLA compiled analysis")
  rows = [(f"memory/device {name} step", f"{gib[name]:.1f} GiB", "", None, note)
          for name in memory.STEPS]
  return rows + [("memory align / ce", f"{gib['align'] / gib['ce']:.2f}x", "", None, note)]


def step_rows(model: str, batch: int, rounds: int, repeats: int):
  best = alignment_step.measure(model, batch, rounds, repeats)
  ce_ms = f"ce step {best['ce'] * 1e3:.3g} ms, batch {batch}"
  floor = f"; its floor, the five gradients + Gram alone: {best['gradients'] / best['ce']:.2f}x"
  sera_target = "<= 1.2x" if model.startswith("resnet") else ""
  return [
      (f"align / ce  {model}", f"{best['alignment'] / best['ce']:.2f}x", "<= 4x",
       best["alignment"] / best["ce"] <= 4, ce_ms + floor),
      (f"sera / ce   {model}", f"{best['sera'] / best['ce']:.2f}x", sera_target,
       best["sera"] / best["ce"] <= 1.2 if sera_target else None, ce_ms),
  ]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=["mlp", "resnet18", "resnet50"])
  parser.add_argument("--batch", type=int, default=16,
                      help="prompts per step of the ResNet step ratios (a small batch)")
  parser.add_argument("--mlp-batch", type=int, default=base_config().batch_size,
                      help="prompts per step of the MLP ratios (default: the default config's)")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--sizes", type=int, nargs="+", default=[256, 4096, 65536])
  parser.add_argument("--memory-batch", type=int, default=256,
                      help="prompts a device of the memory rows (0: skip them)")
  args = parser.parse_args()
  start = time.perf_counter()
  rows = memory_rows(args.memory_batch) if args.memory_batch else []
  for num_prompts in args.sizes:
    rows += allocator_rows(num_prompts, repeats=max(args.repeats, 3))
  for model in args.models:
    batch = args.mlp_batch if model == "mlp" else args.batch
    rows += step_rows(model, batch, args.rounds, args.repeats)
  print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), "
        f"{jax.device_count()} device(s), jax {jax.__version__}, "
        f"{time.perf_counter() - start:.0f} s")
  width = max(len(row[0]) for row in rows)
  print(f"{'benchmark':<{width}}  {'value':>10}  {'target':>8}  {'ok':>3}  notes")
  for name, value, target, ok, note in sorted(rows, key=_row_order):
    mark = "" if ok is None else "yes" if ok else "NO"
    print(f"{name:<{width}}  {value:>10}  {target:>8}  {mark:>3}  {note}")


def _row_order(row):
  return (0 if row[0].startswith(("align", "sera")) else 1 if row[0].startswith("allocate")
          else 2)


if __name__ == "__main__":
  main()
