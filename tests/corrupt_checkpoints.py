"""A checkpoint corrupted as an interrupted copy leaves it, and a directory's bytes to compare."""


def listing(directory):
  """{relative path: bytes, or None for a directory} of everything under `directory`."""
  return {str(path.relative_to(directory)): None if path.is_dir() else path.read_bytes()
          for path in sorted(directory.rglob("*"))}


def corrupt_checkpoint(directory, step):
  """Truncates the largest data file of the checkpoint of `step` in `directory`/checkpoints."""
  data = max((path for path in (directory / "checkpoints" / str(step)).rglob("d/*")),
             key=lambda path: path.stat().st_size)
  data.write_bytes(data.read_bytes()[:100])
