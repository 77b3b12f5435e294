"""Graders of math answers: the rewards of the LLM setting and the scores of `evaluate`.

Each grader gives a completion 1 or 0 against a reference answer (a reward is exactly 0.0 or
1.0, as SERA needs; docs/method.md#llm-post-training):

* `number_correct` (GSM8K): the reference is a number (`gsm8k_answer` reads it after "####" in
  a GSM8K solution) and the completion is right when its last number equals it as a number:
  "1,234", "1{,}234" and "1\\,234" are 1234, "42." is 42, "$18.00" is 18, "12 dollars" is 12,
  "-5" is negative, but the hyphen of "3-5" is no minus sign.
* `math_correct` (MATH, POLARIS, AIME, ...): Hugging Face's math-verify, as the SERA authors
  grade: the reference parsed as the content of a \\boxed{}, the completion's answer found as
  LaTeX (the last \\boxed{}, nested braces and all, first) or a plain expression, and the two
  compared as SymPy objects, so that \\frac{1}{2}, \\dfrac12, 1/2 and 0.5 are one answer.

math-verify bounds its parsing and each comparison with SIGALRM, which only the main thread
may set: called from another thread (Tunix scores rollouts in an executor thread) it raises.
`math_correct` turns both timeouts off (parsing_timeout and timeout_seconds None), so it works
in any thread, but an answer such as 9^{9^{9^9}} then never finishes: `MathGrader` runs it in
worker processes instead, gives each answer `deadline_s` seconds and grades an overrun 0.
"""

import collections
import logging
import multiprocessing
import re
import threading
import time
from collections.abc import Sequence
from decimal import Decimal
from multiprocessing import connection as mp_connection

import numpy as np
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

# Thousands separators: a comma between digits followed by exactly three digits, or its LaTeX
# forms (MATH's "1{,}000", a thin space "1\,000") and the Unicode thin and narrow spaces.
_THOUSANDS = re.compile(r"(?<=\d)(?:,|\{,\}|\\,|\u2009|\u202f)(?=\d{3}(?!\d))")
# A number. A hyphen is its sign only where no letter, digit or period precedes it ("3-5" is a
# range, "x-5" a difference), and a period its decimal point only before a digit ("42." ends a
# sentence).
_NUMBER = re.compile(r"(?:(?<![\w.])-)?\d+(?:\.\d+)?")
_MINUS = "\u2212"  # the Unicode minus sign, written as "-"
# What math-verify extracts: the reference as LaTeX (it is parsed as \boxed{reference}); the
# completion as a plain expression or as LaTeX, as the SERA authors' evaluation does.
_REFERENCE_TARGETS = (LatexExtractionConfig(),)
_COMPLETION_TARGETS = (ExprExtractionConfig(), LatexExtractionConfig())


# ---- GSM8K: the exact number --------------------------------------------------------------


def gsm8k_answer(solution: str) -> str:
  """The final answer of a GSM8K solution: the number after "####", commas removed.

  Raises:
    ValueError: the solution does not end with "#### <number>".
  """
  number = solution.rpartition("####")[2].strip().replace(",", "")
  if "####" not in solution or not _NUMBER.fullmatch(number):
    raise ValueError(f"a GSM8K answer ends with '#### <number>'; got {solution[-80:]!r}.")
  return number


def last_number(text: str) -> Decimal | None:
  """The last number written in `text` ("$" and thousands separators dropped), or None."""
  text = _THOUSANDS.sub("", text.replace("$", "").replace(_MINUS, "-"))
  numbers = _NUMBER.findall(text)
  return Decimal(numbers[-1]) if numbers else None


def number_correct(completion: str, reference: str) -> bool:
  """Whether the completion's last number equals the reference number (18.00 == 18)."""
  guess = last_number(completion)
  return guess is not None and guess == Decimal(str(reference))


def number_reward(prompts, completions, answer, **unused) -> list[float]:
  """Tunix's reward function of `number_correct`: 1.0 or 0.0 a completion."""
  del prompts, unused
  return [float(number_correct(c, a)) for c, a in zip(completions, answer, strict=True)]


# ---- MATH: math-verify --------------------------------------------------------------------


def math_correct(completion: str, reference: str) -> bool:
  """Whether math-verify finds the completion's answer equal to the reference.

  Without a time limit (see the module docstring): in any thread, but `MathGrader` is what
  bounds the time an answer may take.
  """
  gold = parse(f"\\boxed{{{reference}}}", _REFERENCE_TARGETS, parsing_timeout=None)
  guess = parse(completion, _COMPLETION_TARGETS, parsing_timeout=None)
  return bool(gold and guess) and verify(gold, guess, timeout_seconds=None)


def _serve(conn: mp_connection.Connection) -> None:
  """A grading worker: (completion, reference) pairs in, `math_correct` out, until None."""
  # math-verify warns, once, that its timeouts are off; here the parent's deadline bounds it.
  logging.getLogger("math_verify").setLevel(logging.ERROR)
  math_correct("1", "1")  # math-verify builds its parsers lazily: not on a graded answer's time
  conn.send("ready")
  while (item := conn.recv()) is not None:
    conn.send(math_correct(*item))


class _Worker:
  """One grading process and the parent's end of its pipe."""

  def __init__(self):
    context = multiprocessing.get_context("spawn")  # a fork of a process running JAX may hang
    self.conn, child = context.Pipe()
    self.process = context.Process(target=_serve, args=(child,), daemon=True)
    self.process.start()
    child.close()

  def wait_ready(self) -> "_Worker":
    """Waits out the worker's imports and warm-up, which are on no answer's time."""
    self.conn.recv()
    return self

  def stop(self) -> None:
    """Lets the (idle) worker return."""
    self.conn.send(None)
    self.process.join()
    self.conn.close()

  def kill(self) -> None:
    self.process.kill()
    self.process.join()
    self.conn.close()


class MathGrader:
  """`math_correct` in `processes` worker processes, each answer given `deadline_s` seconds.

  A worker still grading after its deadline (or dead) is killed and replaced and its answer
  graded 0 (`failures` counts them). Workers are spawned, not forked, and start with the
  grader (a few seconds each, outside any deadline). One call grades at a time; calls may come
  from any thread. Close the grader (or use it as a context manager) to stop the workers. As
  for any spawned process, a script that makes one guards its entry point with
  `if __name__ == "__main__":` (the workers import the script's module).
  """

  def __init__(self, processes: int = 1, deadline_s: float = 10.0):
    if processes < 1 or deadline_s <= 0:
      raise ValueError(f"a MathGrader needs processes >= 1 and deadline_s > 0; got "
                       f"{processes} and {deadline_s}.")
    self.deadline_s = deadline_s
    self.failures = 0
    self._lock = threading.Lock()
    self._workers = [worker.wait_ready() for worker in [_Worker() for _ in range(processes)]]

  def __call__(self, completions: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """float64 [len(completions)]: 1.0 where `math_correct`, else 0.0 (a failure too)."""
    items = list(zip(completions, references, strict=True))
    verdicts = np.zeros(len(items))
    with self._lock:
      if not self._workers:
        raise ValueError("this MathGrader is closed.")
      pending = collections.deque(range(len(items)))
      idle = list(range(len(self._workers)))
      busy = {}  # worker -> (item, when its deadline passes)
      while pending or busy:
        while pending and idle:
          worker, item = idle.pop(), pending.popleft()
          self._workers[worker].conn.send(items[item])
          busy[worker] = (item, time.monotonic() + self.deadline_s)
        first_deadline = min(deadline for _, deadline in busy.values())
        mp_connection.wait([self._workers[w].conn for w in busy],
                           timeout=max(first_deadline - time.monotonic(), 0.0))
        for worker, (item, deadline) in list(busy.items()):
          # Polled now, not from the wait: a replacement started in this loop takes seconds.
          if self._workers[worker].conn.poll():
            try:
              verdicts[item] = float(self._workers[worker].conn.recv())
            except EOFError:  # the worker died (out of memory on a huge number, say)
              self._replace(worker)
          elif time.monotonic() >= deadline:
            self._replace(worker)
          else:
            continue
          del busy[worker]
          idle.append(worker)
    return verdicts

  def _replace(self, worker: int) -> None:
    """Kills a worker that overran its deadline or died, and starts another; its answer is 0."""
    self._workers[worker].kill()
    self._workers[worker] = _Worker().wait_ready()
    self.failures += 1

  def math_reward(self, prompts, completions, answer, **unused) -> list[float]:
    """Tunix's reward function of the grader: 1.0 or 0.0 a completion."""
    del prompts, unused
    return self(completions, answer).tolist()

  def close(self) -> None:
    """Stops the workers."""
    with self._lock:
      for worker in self._workers:
        worker.stop()
      self._workers = []

  def __enter__(self) -> "MathGrader":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
