"""Shared test fixtures."""

import jax
import pytest


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
