"""Problem files a user prepares once (GSM8K, MATH, POLARIS, MATH-500, AIME...), Parquet or JSONL.

A file is read whole, through epath (a local path or gs://), with the fields its `FORMATS`
entry names, as the SERA authors' scripts take them:

* "gsm8k": question, answer (a solution ending "#### <number>"; the reference is the number):
  openai/gsm8k main, madrylab/gsm8k-platinum; graded by the exact number.
* "math": problem, answer: HuggingFaceH4/MATH-500, POLARIS-Project/Polaris-Dataset-53K,
  math-ai/aime25, ByteDance-Seed/BeyondAIME; graded by math-verify.
* "minerva": question, answer: math-ai/minervamath.
* "olympiadbench": question, final_answer (a list of one "$answer$"): Qwen2.5-Math's
  OlympiadBench test.jsonl.
* "verl": extra_info.question, reward_model.ground_truth: the Parquet files verl trains on,
  as the SERA authors' evaluation/prepare_data.py writes them.
* "simplerl": extra_info.question, extra_info.answer: hkust-nlp/SimpleRL-Zoo-Data (MATH
  levels 3-5 and the rest).

A dotted field is a field of a record-valued field. `load` refuses a file that lacks a field,
or a row with an empty question or answer, in one line naming the file, the field and the
fields it has; `columns` turns the problems into the learner's batch columns.
"""

import json
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
from etils import epath
from pyarrow import parquet

from sera_jax.common import files
from sera_jax.method import validation
from sera_jax.settings.llm import grading

INSTRUCTION = ("Solve the problem step by step, then write the final answer as a plain number "
               "at the very end.")
# What the prompt asks of the answer, so that the problem's grader finds it.
INSTRUCTIONS = {
    "number": INSTRUCTION,
    "math": "Please reason step by step, and put your final answer within \\boxed{}.",
}


def _text(value: Any) -> str:
  return str(value).strip()


def _single_answer(value: Any) -> str:
  """OlympiadBench's final_answer: a list of one answer in $...$."""
  if not isinstance(value, list) or len(value) != 1:
    raise ValueError(f"final_answer must be a list of one answer; got {value!r}.")
  return str(value[0]).strip().strip("$").strip()


class Format(NamedTuple):
  """Where a problem file keeps a problem, and how its reference answer is read and graded."""
  question: str  # the field of the problem's text
  answer: str  # the field the reference answer is read from
  reference: Callable[[Any], str]  # that field's value -> the reference the grader takes
  grader: str  # "number" (`grading.number_correct`) or "math" (`grading.math_correct`)


FORMATS = {
    "gsm8k": Format("question", "answer", grading.gsm8k_answer, "number"),
    "math": Format("problem", "answer", _text, "math"),
    "minerva": Format("question", "answer", _text, "math"),
    "olympiadbench": Format("question", "final_answer", _single_answer, "math"),
    "verl": Format("extra_info.question", "reward_model.ground_truth", _text, "math"),
    "simplerl": Format("extra_info.question", "extra_info.answer", _text, "math"),
}


class Problems(NamedTuple):
  """The problems of a file, in its order."""
  questions: list[str]
  answers: list[str]  # the reference answers, as `grader` takes them
  index: np.ndarray  # int64 [P]: 0..P-1, the dataset index the learner keys estimates by
  grader: str  # "number" or "math"


def read_records(location: epath.PathLike) -> list[dict[str, Any]]:
  """Every row of a .parquet or .jsonl file, as a dict (a record-valued field as a dict).

  Raises:
    FileNotFoundError: no such file.
    ValueError: another suffix, or a JSONL line that is not JSON.
  """
  path = files.path(location)
  if path.suffix not in (".parquet", ".jsonl"):
    raise ValueError(f"{location}: a problem file is .parquet or .jsonl; got {path.suffix!r}.")
  if not path.exists():
    raise FileNotFoundError(f"no problem file {location}.")
  if path.suffix == ".parquet":
    return parquet.read_table(pa.BufferReader(path.read_bytes())).to_pylist()
  records = []
  for number, line in enumerate(path.read_text().splitlines(), start=1):
    if line.strip():
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError as error:
        raise ValueError(f"{location}: line {number} is not JSON ({error}).") from None
  return records


def field_names(record: dict[str, Any], prefix: str = "") -> list[str]:
  """The fields of `record`, a record-valued field's own as `field.subfield` too."""
  names = []
  for key, value in record.items():
    names.append(f"{prefix}{key}")
    if isinstance(value, dict):
      names.extend(field_names(value, f"{prefix}{key}."))
  return names


def _value(record: dict[str, Any], field: str) -> Any:
  """The value of the (dotted) `field` of `record`; KeyError when it has none."""
  value = record
  for key in field.split("."):
    if not isinstance(value, dict) or key not in value:
      raise KeyError(field)
    value = value[key]
  return value


def load(location: epath.PathLike, format_name: str) -> Problems:
  """The problems of the file at `location` in the format `format_name` (a key of FORMATS).

  Raises:
    ValueError: an unknown format, an empty file, a missing field (the message names the
      file, the field and the fields the file has), an empty question or reference answer,
      or a reference its format cannot read.
    FileNotFoundError: no such file.
  """
  spec = FORMATS[validation.choice("the problem format", format_name, tuple(FORMATS))]
  records = read_records(location)
  if not records:
    raise ValueError(f"{location} holds no problems.")
  questions, answers = [], []
  for row, record in enumerate(records):
    try:
      question, answer = _value(record, spec.question), _value(record, spec.answer)
    except KeyError as missing:
      where = f"{location} has" if row == 0 else f"{location}: row {row} has"
      raise ValueError(f"{where} no field {missing.args[0]!r}, which the {format_name!r} format "
                       f"reads (fields: {', '.join(field_names(record))}).") from None
    try:
      reference = spec.reference(answer) if answer is not None else ""
    except ValueError as error:
      raise ValueError(f"{location}: row {row}: {error}") from None
    for field, text in ((spec.question, question), (spec.answer, reference)):
      if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{location}: row {row} has an empty {field!r}.")
    questions.append(question)
    answers.append(reference)
  return Problems(questions, answers, np.arange(len(records), dtype=np.int64), spec.grader)


def columns(loaded: Problems, tokenizer, *, max_prompt_length: int,
            enable_thinking: bool = False, instruction: str | None = None
            ) -> dict[str, np.ndarray]:
  """The learner's batch columns of the `loaded` problems ("prompts", "answer", "idx"): each
  question with `instruction` (default its grader's `INSTRUCTIONS`) in the tokenizer's chat
  template (`problems`)."""
  return problems(loaded.questions, loaded.answers, tokenizer,
                  max_prompt_length=max_prompt_length, enable_thinking=enable_thinking,
                  instruction=instruction or INSTRUCTIONS[loaded.grader])


def prompt(question: str, tokenizer, *, enable_thinking: bool = False,
           instruction: str = INSTRUCTION) -> str:
  """The question and `instruction`, as a user turn of the tokenizer's chat template if any."""
  text = f"{question.strip()}\n{instruction}"
  if getattr(tokenizer, "chat_template", None) is None:
    return text
  return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True,
                                       enable_thinking=enable_thinking)


def problems(questions: Sequence[str], answers: Sequence[str], tokenizer, *,
             max_prompt_length: int, enable_thinking: bool = False,
             instruction: str = INSTRUCTION) -> dict[str, np.ndarray]:
  """The batch columns of every problem: "prompts" (`prompt` with `instruction`), "answer" and
  "idx" (0..P-1).

  Raises:
    ValueError: a prompt is longer than max_prompt_length tokens (Tunix's sampler would
      otherwise fail on the KV cache when a batch first holds it), or it holds the
      tokenizer's pad token, which Tunix's sampler and loss mask out of every sequence.
  """
  prompts = [prompt(q, tokenizer, enable_thinking=enable_thinking, instruction=instruction)
             for q in questions]
  encoded = [tokenizer.encode(p) for p in prompts]
  padded = next((i for i, tokens in enumerate(encoded) if tokenizer.pad_id() in tokens), None)
  if padded is not None:
    raise ValueError(f"problem {padded}'s prompt holds the tokenizer's pad token (id "
                     f"{tokenizer.pad_id()}), which Tunix's sampler and loss mask out of every "
                     f"sequence, so the policy would not see it: set config.pad_token to a "
                     f"token no prompt holds.")
  # Tokens as Tunix's sampler counts them: BOS (when the tokenizer has one), then the text.
  lengths = [len(tokens) + bool(tokenizer.bos_id()) for tokens in encoded]
  longest = int(np.argmax(lengths))
  if lengths[longest] > max_prompt_length:
    raise ValueError(f"problem {longest}'s prompt has {lengths[longest]} tokens, more than "
                     f"config.max_prompt_length={max_prompt_length}; raise it (and "
                     f"config.kv_cache_size).")
  return {"prompts": np.array(prompts), "answer": np.array(answers),
          "idx": np.arange(len(prompts), dtype=np.int64)}
