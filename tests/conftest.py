"""Shared test fixtures, and one XLA compilation cache for the whole test session."""

import os
import shutil
import tempfile

import jax
import pytest

# Most of a test's time here is XLA compiling programs that then run on tiny inputs. Without
# LLVM's optimisations a program compiles in about half the time; the processes tests launch
# inherit the flag.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0").strip()

# Many tests build a fresh learner, task or step whose program an earlier test already compiled
# (a new closure is a new jit cache entry), in separate test processes and subprocesses. One
# persistent cache for the session, shared by the xdist workers and the processes tests launch
# (they inherit the environment), compiles each such program once. The controller makes it
# before the workers start and deletes it at the end.
_CACHE = "JAX_COMPILATION_CACHE_DIR"
_OWN_CACHE = _CACHE not in os.environ
if _OWN_CACHE:
  os.environ[_CACHE] = tempfile.mkdtemp(prefix="sera_jax_tests_xla_cache_")
jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE])


def pytest_unconfigure(config):
  if _OWN_CACHE and not hasattr(config, "workerinput"):
    shutil.rmtree(os.environ[_CACHE], ignore_errors=True)


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
