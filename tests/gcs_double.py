"""A filesystem double of Cloud Storage: gs://BUCKET/KEY lives at ROOT/BUCKET/KEY.

Only the layers that would reach the network are replaced; sera_jax's own code runs
exactly as it does against a real bucket:

* etils.epath, through which sera_jax and Orbax open, list and delete files:
  `epath.testing.mock_epath`, every gs:// path mapped under ROOT (and back, for
  paths it returns), with epath told that TensorFlow is absent so that it consults
  that (mocked) backend table instead of TensorFlow's gfile;
* TensorStore, through which Orbax writes array data: Orbax's GCS kvstore spec
  becomes a file kvstore at the mapped path;
* Orbax's bucket lookup (whether the bucket has a hierarchical namespace, asked
  before deleting an old checkpoint): a bucket without one.

As a script it runs the `sera-jax` command under the double:

  python tests/gcs_double.py ROOT train --workdir=gs://bucket/run ...
"""

import contextlib
import os
import sys
import types
from unittest import mock

from etils.epath import gpath
from etils.epath import testing as epath_testing
from orbax.checkpoint._src.path import gcs_utils

PREFIX = "gs://"


@contextlib.contextmanager
def serve(root: str):
  """Serves gs:// from the local directory `root` for the duration of the block."""
  root = os.path.abspath(root)

  def local(path) -> str:
    text = os.fspath(path)
    return os.path.join(root, text[len(PREFIX):]) if text.startswith(PREFIX) else text

  def remote(path: str) -> str:
    inside = os.path.relpath(path, root)
    return path if inside.startswith("..") else PREFIX + inside

  def mapped(original, path, *args, **kwargs):
    return original(local(path), *args, **kwargs)

  def mapped_pair(original, path, destination, **kwargs):
    return original(local(path), local(destination), **kwargs)

  def glob(original, pattern):
    return [remote(found) if os.fspath(pattern).startswith(PREFIX) else found
            for found in original(local(pattern))]

  def walk(original, top, **kwargs):
    for directory, dirs, names in original(local(top), **kwargs):
      yield (remote(directory) if os.fspath(top).startswith(PREFIX) else directory), dirs, names

  def kvstore(path: str) -> dict:
    return {"driver": "file", "path": local(path)}

  with contextlib.ExitStack() as stack:
    stack.enter_context(mock.patch.object(gpath, "_is_tf_installed", lambda: False))
    stack.enter_context(epath_testing.mock_epath(
        open=mapped, exists=mapped, isdir=mapped, listdir=mapped, makedirs=mapped, mkdir=mapped,
        remove=mapped, rmtree=mapped, stat=mapped, copy=mapped_pair, rename=mapped_pair,
        replace=mapped_pair, glob=glob, walk=walk))
    stack.enter_context(mock.patch.object(gcs_utils, "get_kvstore_for_gcs", kvstore))
    stack.enter_context(mock.patch.object(
        gcs_utils, "get_bucket", lambda name: types.SimpleNamespace(name=name)))
    yield


if __name__ == "__main__":
  from sera_jax.harness import cli
  with serve(sys.argv[1]):
    cli.main(sys.argv[2:])
