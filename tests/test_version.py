"""sera_jax.__version__ comes from the installed distribution's metadata."""

import importlib
from importlib import metadata

import sera_jax


def test_the_version_is_the_installed_distributions():
  assert sera_jax.__version__ == metadata.version("sera_jax")
  assert sera_jax.__version__.count(".") >= 2


def test_a_source_tree_that_was_never_installed_says_so(monkeypatch):
  def not_installed(name):
    raise metadata.PackageNotFoundError(name)

  monkeypatch.setattr(metadata, "version", not_installed)
  try:
    # Reloading runs the package's own lines again; its submodules stay as they are.
    assert importlib.reload(sera_jax).__version__ == "0+unknown"
  finally:
    monkeypatch.undo()
    importlib.reload(sera_jax)
  assert sera_jax.__version__ == metadata.version("sera_jax")
