"""Shared test fixtures."""

import jax
import pytest


@pytest.fixture
def x64():
  """Runs the test with 64-bit floats enabled, restoring the default after."""
  with jax.enable_x64(True):
    yield
