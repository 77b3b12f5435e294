"""Problem files read as the SERA authors' scripts write them: every format from JSONL and
Parquet, local or gs://, and each missing or empty field refused in one line."""

import json

import gcs_double
import numpy as np
import pyarrow as pa
import pytest
from pyarrow import parquet
from tiny_qwen import save_tokenizer

from sera_jax.harness import configs
from sera_jax.settings.llm import data, gsm8k

# Two rows of each format, its fields as the sources name them, and the (questions, references,
# grader) they are read as.
ROWS = {
    "gsm8k": ([{"question": "How many pens?", "answer": "1,200 + 300 = 1,500\n#### 1,500"},
               {"question": "How cold?", "answer": "It fell to -5.\n#### -5"}],
              (["How many pens?", "How cold?"], ["1500", "-5"], "number")),
    "math": ([{"problem": "What is $1/2 + 0$?", "solution": "...", "answer": "\\frac{1}{2}",
               "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"},
              {"problem": "Find $x$.", "solution": "...", "answer": 70, "id": "II-1"}],
             (["What is $1/2 + 0$?", "Find $x$."], ["\\frac{1}{2}", "70"], "math")),
    "minerva": ([{"question": "A speed?", "answer": "3e8"}, {"question": "A mass?", "answer": "2"}],
                (["A speed?", "A mass?"], ["3e8", "2"], "math")),
    "olympiadbench": ([{"question": "Which $x$?", "final_answer": ["$\\frac{\\pi}{2}$"]},
                       {"question": "How many?", "final_answer": ["$12$"]}],
                      (["Which $x$?", "How many?"], ["\\frac{\\pi}{2}", "12"], "math")),
    "verl": ([{"data_source": "math500", "prompt": [{"role": "user", "content": "Q1 boxed"}],
               "ability": "math", "reward_model": {"style": "rule", "ground_truth": "\\pi"},
               "extra_info": {"split": "test", "index": 0, "question": "Q1", "answer": "\\pi"}},
              {"data_source": "math500", "prompt": [{"role": "user", "content": "Q2 boxed"}],
               "ability": "math", "reward_model": {"style": "rule", "ground_truth": "4"},
               "extra_info": {"split": "test", "index": 1, "question": "Q2", "answer": "4"}}],
             (["Q1", "Q2"], ["\\pi", "4"], "math")),
    "simplerl": ([{"prompt": [{"role": "user", "content": "<|im_start|>..."}],
                   "extra_info": {"question": "Q1", "answer": "5"}},
                  {"prompt": [{"role": "user", "content": "<|im_start|>..."}],
                   "extra_info": {"question": "Q2", "answer": "\\sqrt{2}"}}],
                 (["Q1", "Q2"], ["5", "\\sqrt{2}"], "math")),
}


def write(path, rows) -> str:
  """`rows` as a .jsonl or .parquet file at `path`."""
  if path.suffix == ".parquet":
    parquet.write_table(pa.Table.from_pylist(rows), path)
  else:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
  return str(path)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("format_name", sorted(ROWS))
def test_each_format_reads_its_questions_and_references(tmp_path, format_name, suffix):
  rows, (questions, answers, grader) = ROWS[format_name]
  if suffix == ".parquet" and format_name == "math":
    rows = [{key: str(value) for key, value in row.items()} for row in rows]  # one type a column
  problems = data.load(write(tmp_path / f"problems{suffix}", rows), format_name)
  assert (problems.questions, problems.answers, problems.grader) == (questions, answers, grader)
  np.testing.assert_array_equal(problems.index, [0, 1])


def test_a_file_on_cloud_storage_reads_through_epath(tmp_path):
  (tmp_path / "bucket" / "aime25").mkdir(parents=True)
  write(tmp_path / "bucket" / "aime25" / "test.jsonl", ROWS["math"][0])
  with gcs_double.serve(str(tmp_path)):
    problems = data.load("gs://bucket/aime25/test.jsonl", "math")
  assert problems.answers == ["\\frac{1}{2}", "70"]


@pytest.mark.parametrize("format_name, rows, message", [
    ("gsm8k", ROWS["math"][0][:1],
     r"^\S+/problems.jsonl has no field 'question', which the 'gsm8k' format reads \(fields: "
     r"problem, solution, answer, subject, level, unique_id\)\.$"),
    ("verl", [{"reward_model": {"ground_truth": "1"}, "extra_info": {"index": 0}}],
     r"no field 'extra_info.question', which the 'verl' format reads \(fields: reward_model, "
     r"reward_model.ground_truth, extra_info, extra_info.index\)\.$"),
    ("math", [{"problem": "a", "answer": "1"}, {"problem": "b"}],
     r"/problems.jsonl: row 1 has no field 'answer', .*\(fields: problem\)\.$"),
    ("math", [{"problem": "a", "answer": " "}], r"row 0 has an empty 'answer'\.$"),
    ("math", [{"problem": "a", "answer": None}], r"row 0 has an empty 'answer'\.$"),
    ("math", [{"problem": "", "answer": "1"}], r"row 0 has an empty 'problem'\.$"),
    ("gsm8k", [{"question": "a", "answer": "no number"}], r"row 0: a GSM8K answer ends with"),
    ("olympiadbench", [{"question": "a", "final_answer": ["$1$", "$2$"]}],
     r"row 0: final_answer must be a list of one answer"),
    ("maths", [{"problem": "a", "answer": "1"}], r"format must be one of 'gsm8k', 'math'"),
    ("math", [], r"holds no problems"),
])
def test_a_file_without_what_its_format_reads_is_refused_in_one_line(tmp_path, format_name, rows,
                                                                      message):
  with pytest.raises(ValueError, match=message) as error:
    data.load(write(tmp_path / "problems.jsonl", rows), format_name)
  assert "\n" not in str(error.value)


def test_only_parquet_and_jsonl_files_that_exist_and_parse(tmp_path):
  with pytest.raises(ValueError, match=r"\.parquet or \.jsonl; got '\.json'"):
    data.load(write(tmp_path / "problems.json", ROWS["math"][0]), "math")
  with pytest.raises(FileNotFoundError, match="no problem file"):
    data.load(tmp_path / "absent.jsonl", "math")
  (tmp_path / "broken.jsonl").write_text('{"problem": "a", "answer": "1"}\n{"problem": \n')
  with pytest.raises(ValueError, match="line 2 is not JSON"):
    data.load(tmp_path / "broken.jsonl", "math")


def test_the_columns_ask_for_the_answer_each_grader_reads(tmp_path):
  """GSM8K's prompt asks for a plain number at the end, MATH's for a \\boxed{} answer; both in
  the tokenizer's chat template, with the learner's columns."""
  save_tokenizer(tmp_path)
  tokenizer = gsm8k.load_tokenizer(configs.load("gsm8k_qwen3"), str(tmp_path))
  for format_name, instruction in (("gsm8k", gsm8k.INSTRUCTION),
                                   ("math", "put your final answer within \\boxed{}.")):
    problems = data.load(write(tmp_path / f"{format_name}.jsonl", ROWS[format_name][0]),
                         format_name)
    columns = data.columns(problems, tokenizer, max_prompt_length=256)
    assert columns["prompts"][0].startswith(f"<|im_start|>user\n{problems.questions[0]}\n")
    assert columns["prompts"][0].endswith(f"{instruction}<|im_end|>\n<|im_start|>assistant\n")
    assert columns["answer"].tolist() == problems.answers
    np.testing.assert_array_equal(columns["idx"], problems.index)


def test_a_prompt_holding_the_pad_token_is_refused_and_config_pad_token_pads_with_another(
    tmp_path):
  """A tokenizer that pads with its EOS, <|im_end|>, finds it inside every ChatML prompt, where
  Tunix's sampler and loss would mask it: refused in one line. config.pad_token pads with a
  token no prompt holds, which must be one token of the vocabulary."""
  save_tokenizer(tmp_path, pad_token="<|im_end|>")
  problems = data.load(write(tmp_path / "gsm8k.jsonl", ROWS["gsm8k"][0]), "gsm8k")
  config = configs.load("gsm8k_qwen3")
  with pytest.raises(ValueError, match=r"^problem 0's prompt holds the tokenizer's pad token "
                                       r"\(id \d+\), .*set config\.pad_token to a token no "
                                       r"prompt holds\.$"):
    data.columns(problems, gsm8k.load_tokenizer(config, str(tmp_path)), max_prompt_length=256)
  config.pad_token = "<|endoftext|>"
  tokenizer = gsm8k.load_tokenizer(config, str(tmp_path))
  assert tokenizer.pad_id() == tokenizer.encode("<|endoftext|>")[0] != tokenizer.eos_id()
  assert len(data.columns(problems, tokenizer, max_prompt_length=256)["prompts"]) == 2
  config.pad_token = "ab"
  with pytest.raises(ValueError, match=r"^config\.pad_token: 'ab' is 2 tokens of this "
                                       r"tokenizer, not one\.$"):
    gsm8k.load_tokenizer(config, str(tmp_path))
