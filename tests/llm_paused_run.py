"""A child process of the LLM resume test: trains the tiny decoder with SERA for 8 steps and,
once the actor checkpoint of step `pause_at` is on disk, says so on stdout and waits there.

The test kills it while it waits, so the kill lands at a point the test has observed, never
at a moment chosen by timing.

    python tests/llm_paused_run.py CHECKPOINT_DIR PAUSE_AT
"""

import sys

from tunix.sft import checkpoint_manager

from sera_jax.settings.llm import tiny


def main(checkpoint_dir: str, pause_at: int) -> None:
  save = checkpoint_manager.CheckpointManager.save

  def save_then_wait(self, step, *args, **kwargs):
    saved = save(self, step, *args, **kwargs)
    if saved and step == pause_at:
      self._checkpoint_manager.wait_until_finished()  # Orbax saves asynchronously
      print(f"checkpointed {step}", flush=True)
      sys.stdin.readline()  # the test never writes: this waits for its SIGKILL
    return saved

  checkpoint_manager.CheckpointManager.save = save_then_wait
  tiny.train_sera(8, checkpoint_dir)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]))
