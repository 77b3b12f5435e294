"""Shared test fixtures, and one persistent XLA compilation cache for the test sessions."""

import os
import pathlib
import shutil

import jax
import pytest
from hypothesis import settings

# Property tests draw their examples from a seed fixed per test, so every run of the suite (a
# landing's CI among them) tests the same inputs; HYPOTHESIS_PROFILE=explore draws new ones.
settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))

# Most of a test's time here is XLA compiling programs that then run on tiny inputs. Without
# LLVM's optimisations a program compiles in about half the time, and XLA:CPU's older
# elemental emitters compile fused loops faster than its MLIR fusion emitters (the Tunix runs
# of test_llm_mesh.py: 105 s -> 65 s); the processes tests launch inherit the flags.
for _flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
  if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

# Many tests build a fresh learner, task or step whose program an earlier test already compiled
# (a new closure is a new jit cache entry), in separate test processes and subprocesses. One
# persistent cache, shared by the xdist workers and the processes tests launch (they inherit
# the environment), compiles each such program once; every program is kept, however fast its
# compile (most compile in well under JAX's default threshold of a second). The cache lives in
# .pytest_cache beside pytest's own, so a later session (the edit-test loop) compiles only what
# changed: the key is the program and the JAX version, so an edited function is a new entry,
# never a stale one. A clean clone starts it empty; the session that finds it over _CACHE_BYTES
# deletes it at its end (JAX's own size cap tracks every access on disk, which costs more
# than it saves here).
_CACHE = "JAX_COMPILATION_CACHE_DIR"
_CACHE_BYTES = 1 << 30
_OWN_CACHE = _CACHE not in os.environ
os.environ.setdefault(_CACHE, str(pathlib.Path(__file__).parents[1] / ".pytest_cache"
                                  / "jax_compilation_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


def pytest_unconfigure(config):
  if _OWN_CACHE and not hasattr(config, "workerinput"):  # the controller, at the very end
    cache = pathlib.Path(os.environ[_CACHE])
    if sum(entry.stat().st_size for entry in cache.glob("*") if entry.is_file()) > _CACHE_BYTES:
      shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture
def x64():
  """Runs the test with 64-bit floats enabled, restoring the default after."""
  with jax.enable_x64(True):
    yield


@pytest.fixture(scope="module")
def digits_problem():
  """(task, initial state, one fixed batch of 16 digits) of the default config."""
  from sera_jax.harness.configs.base import classification as base_config
  from sera_jax.harness.figures import common
  from sera_jax.settings.classification.task import ClassificationTask
  config = base_config()
  config.batch_size = 16
  task = ClassificationTask(config)
  return task, task.init_state(jax.random.PRNGKey(0)), common.evaluation_batches(
      task.dataset, 16, 1)[0]
