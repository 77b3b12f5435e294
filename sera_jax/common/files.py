"""Every file a run reads or writes goes through `etils.epath`.

So a `gs://` URL works wherever a local path does (Orbax and tfds already
resolve paths with epath). Object stores have no append and no cheap partial
write: writers here produce whole files, or stream one file that each flush
uploads whole (see `sera_jax.harness.train`).
"""

import csv
import io
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from etils import epath


def is_url(location: epath.PathLike) -> bool:
  """True for a URL such as gs://bucket/dir (a location no local call may touch)."""
  return "://" in os.fspath(location)


def path(location: epath.PathLike) -> epath.Path:
  """`location` as an epath.Path: a URL unchanged, a local path made absolute (as Orbax needs)."""
  return epath.Path(location if is_url(location) else os.path.abspath(os.fspath(location)))


def storage_errors() -> tuple[type[Exception], ...]:
  """What a failed storage call raises: OSError, or TensorFlow's error where its gfile serves URLs.

  Call it inside an `except` clause, so TensorFlow is imported only when something failed.
  """
  from sera_jax.common.tf import tensorflow
  return OSError, tensorflow().errors.OpError


def write_csv(location: epath.PathLike, rows: Sequence[Mapping[str, Any]],
              fieldnames: Sequence[str] | None = None) -> None:
  """Writes dict rows as one CSV file (header: `fieldnames`, default the first row's keys)."""
  buffer = io.StringIO()
  writer = csv.DictWriter(buffer, fieldnames=list(fieldnames or rows[0]))
  writer.writeheader()
  writer.writerows(rows)
  write_text(location, buffer.getvalue())


def read_csv(location: epath.PathLike) -> list[dict[str, str]]:
  """The rows of a CSV file (as `write_csv` writes them), each a dict of its header's keys."""
  # csv reads its own line ends (newline=""): universal newlines would turn a quoted "\r"
  # into "\n".
  return list(csv.DictReader(io.StringIO(path(location).read_bytes().decode(), newline="")))


def write_text(location: epath.PathLike, text: str) -> None:
  """Writes `text` as the whole file, creating its directory."""
  target = path(location)
  target.parent.mkdir(parents=True, exist_ok=True)
  target.write_text(text)


def write_bytes(location: epath.PathLike, data: bytes) -> None:
  """Writes `data` as the whole file, creating its directory."""
  target = path(location)
  target.parent.mkdir(parents=True, exist_ok=True)
  target.write_bytes(data)


def copy_tree(source: str, destination: epath.PathLike) -> None:
  """Copies every file under the local directory `source` to `destination`, keeping the tree."""
  local = pathlib.Path(source)
  for file in sorted(local.rglob("*")):
    if file.is_file():
      write_bytes(path(destination) / file.relative_to(local).as_posix(), file.read_bytes())
