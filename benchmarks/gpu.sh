#!/usr/bin/env bash
# The benchmark tables of benchmarks/run.py (in under 5 minutes), benchmarks/sweep.py (in
# under 10), benchmarks/conv_batching.py and benchmarks/step_parts.py (in under 1 each) on one
# NVIDIA GPU.
#
#   bash benchmarks/gpu.sh [extra benchmarks/run.py flags]
#
# Installs the CUDA build of the jax version already installed (so flax, optax and orbax keep
# their pins) unless jax already sees a GPU. JAX_CUDA picks the wheel: cuda12 (default, any
# driver >= 525) or cuda13. Needs the package index or a wheel cache (PIP_FIND_LINKS) for what
# is missing. Offline, put the missing dependencies on PYTHONPATH first: on an image that already
# has a CUDA jax, flax, optax, chex and orbax that is ml_collections (the benchmarks import
# neither TensorFlow nor TensorBoard).
set -euo pipefail
cd "$(dirname "$0")/.."

# The scripts import sera_jax (its verification too) from this checkout, installed or not.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import sera_jax.verification' 2>/dev/null || python3 -m pip install -q -e .
if ! python3 -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
  version=$(python3 -c 'import importlib.metadata as m; print(m.version("jax"))')
  python3 -m pip install -q "jax[${JAX_CUDA:-cuda12}]==${version}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

# Step ratios at batch 32 (a small batch for a GPU), allocator at the three sizes, and the
# ImageNet config's per-device memory at 256 prompts (compiled for the GPU, not run).
timeout 290 python3 benchmarks/run.py --batch 32 --rounds 5 --repeats 10 "$@"

# R = 10 seeds as one vmapped program against the same runs one after another, in one process
# (three rounds of both ways):
# the digits MLP, the small CNN, the maze policy and budget scaling's SERA run at N0 = 1024
# (sera_jax.harness.batched).
timeout 590 python3 benchmarks/sweep.py --models mlp small_cnn maze n0_1024 --runs 10 --steps 100 \
  --maze-steps 20 --repeats 3

# A convolution vmapped over R = 10 runs' kernels against one run after another: XLA's grouped
# convolution, patches times the kernel, and the models' convolution (grouped on a GPU).
timeout 60 python3 benchmarks/conv_batching.py

# Each part of the digits MLP's step (the network's passes, the allocation, the sampling)
# vmapped over R = 10 runs against one run after another: where a batch gains.
timeout 60 python3 benchmarks/step_parts.py
