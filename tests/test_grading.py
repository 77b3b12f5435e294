"""The graders of math answers against a hand-checked table (`CASES`, which docs/llm.md shows as
rendered here), in any thread, and math-verify's hangs bounded by `MathGrader`'s deadline."""

import pathlib
import threading

import pytest

from sera_jax.settings.llm import grading

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "llm.md"
GRADERS = {"number": grading.number_correct, "math": grading.math_correct}
# (grader, completion, reference, correct, why), each label checked by hand.
CASES = [
    ("number", "So she sold 48 + 24 = 72 clips.", "72", 1, "a number followed by a period"),
    ("number", "The answer is 42.", "42", 1, "a number followed by a period"),
    ("number", "The total is $1,234.", "1234", 1, "a dollar sign, a thousands separator"),
    ("number", "She earned 1,234,567 dollars in all", "1234567", 1, "thousands separators"),
    ("number", "So the total is \\boxed{1{,}000}.", "1000", 1, "LaTeX's thousands separator"),
    ("number", "The answer is $1\\,000\\,000$.", "1000000", 1, "LaTeX's thin space"),
    ("number", "It weighs 2\u2009500 grams", "2500", 1, "a thin space"),
    ("number", "12{,}34", "1234", 0, "a separator before two digits separates numbers"),
    ("number", "It costs $18.00", "18", 1, "equal as numbers"),
    ("number", "He has 12 dollars left.", "12", 1, "a unit after the number"),
    ("number", "The answer is **1,000,000**", "1000000", 1, "Markdown around the number"),
    ("number", "0.50 of the cake", "0.5", 1, "equal as numbers"),
    ("number", "So 50% of them", "50", 1, "a percent sign after the number"),
    ("number", "The temperature fell to -5 degrees.", "-5", 1, "a negative number"),
    ("number", "The change is \u22125.", "-5", 1, "the Unicode minus sign"),
    ("number", "\\boxed{-3}", "-3", 1, "a negative number in a box"),
    ("number", "The temperature fell to -5 degrees.", "5", 0, "the sign counts"),
    ("number", "Read pages 3-5", "5", 1, "a hyphen after a digit is no minus sign"),
    ("number", "Read pages 3-5", "-5", 0, "a hyphen after a digit is no minus sign"),
    ("number", "5 apples, then 3 more: 8\n\nDone in 2 steps", "8", 0, "the last number counts"),
    ("number", "72, or maybe 27", "72", 0, "the last number counts"),
    ("number", "The answer is 7.2", "72", 0, "close, but another number"),
    ("number", "The answer is 720", "72", 0, "close, but another number"),
    ("number", "It is 3.14159", "3.14", 0, "close, but another number"),
    ("number", "1,2,3", "123", 0, "commas between single digits separate numbers"),
    ("number", "12,34", "1234", 0, "a comma before two digits separates numbers"),
    ("number", "", "0", 0, "an empty completion"),
    ("number", "seventy-two", "72", 0, "no number"),
    ("math", "So the answer is \\boxed{\\frac{1}{2}}.", "0.5", 1, "a fraction is its decimal"),
    ("math", "The answer is $0.5$", "\\frac{1}{2}", 1, "a decimal is its fraction"),
    ("math", "Thus \\boxed{1/2}", "\\dfrac{1}{2}", 1, "\\dfrac and a slash"),
    ("math", "\\boxed{\\dfrac{1}{2}}", "\\frac12", 1, "\\dfrac and \\frac12"),
    ("math", "\\boxed{-\\frac{1}{2}}", "-0.5", 1, "a negative fraction"),
    ("math", "\\boxed{\\frac{\\sqrt{3}}{3}}", "\\frac{1}{\\sqrt{3}}", 1, "equal forms"),
    ("math", "\\boxed{5\\sqrt{2}}", "\\sqrt{50}", 1, "equal forms"),
    ("math", "\\boxed{x^2+2x+1}", "(x+1)^2", 1, "equal polynomials"),
    ("math", "\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)",
     1, "a tuple"),
    ("math", "\\boxed{\\frac{\\sqrt{2}}{\\sqrt{\\frac{1}{2}}}}", "2", 1, "nested braces in a box"),
    ("math", "\\boxed{\\frac{\\sqrt{2}}{\\sqrt{\\frac{1}{2}}}}", "1", 0, "nested braces in a box"),
    ("math", "\\boxed{2} then later \\boxed{3}", "3", 1, "the last box counts"),
    ("math", "First \\boxed{2}, then on reflection \\boxed{3}", "3", 0,
     "boxes listed with a comma are one answer, the set {2, 3}: a hedge"),
    ("math", "First \\boxed{2}, then on reflection \\boxed{3}", "2", 0,
     "boxes listed with a comma are one answer, the set {2, 3}: a hedge"),
    ("math", "\\boxed{12 \\text{ dollars}}", "12", 1, "a unit in the box"),
    ("math", "\\boxed{90^\\circ}", "90", 1, "degrees"),
    ("math", "\\boxed{1,234}", "1234", 1, "a thousands separator"),
    ("math", "The answer is 42.", "42", 1, "a number followed by a period, no box"),
    ("math", "\\boxed{x=5}", "5", 1, "an assignment's value"),
    ("math", "\\boxed{0.33}", "\\frac{1}{3}", 0, "close, but another number"),
    ("math", "\\boxed{\\frac{1}{2}}", "\\frac{1}{3}", 0, "another fraction"),
    ("math", "\\boxed{3}", "-3", 0, "the sign counts"),
    ("math", "\\boxed{\\sqrt{3}}", "3", 0, "close, but another number"),
    ("math", "\\boxed{2x+1}", "2x-1", 0, "another polynomial"),
    ("math", "", "42", 0, "an empty completion"),
    ("math", "I do not know.", "42", 0, "no answer"),
    ("math", "\\boxed{}", "42", 0, "an empty box"),
]
# A tower of powers: SymPy evaluates it forever (the case math-verify's timeouts exist for).
TOWER = "\\boxed{9^{9^{9^{9}}}}"


def _cell(text: str) -> str:
  return f"`{text}`".replace("\n", "\\n") if text else "(empty)"


def render_table(cases) -> str:
  """`cases` as docs/llm.md shows them: a Markdown table, a row a case."""
  lines = ["| grader | completion | reference | correct | why |",
           "| --- | --- | --- | --- | --- |"]
  lines += [f"| {grader} | {_cell(completion)} | {_cell(reference)} | {correct} | {why} |"
            for grader, completion, reference, correct, why in cases]
  return "\n".join(lines) + "\n"


@pytest.mark.parametrize("grader, completion, reference, correct, why", CASES,
                         ids=[f"{case[0]}-{index}" for index, case in enumerate(CASES)])
def test_the_graders_give_the_hand_checked_labels(grader, completion, reference, correct, why):
  assert GRADERS[grader](completion, reference) is bool(correct), why


def test_the_docs_show_the_table_of_this_test():
  assert render_table(CASES) in DOCS.read_text()


def test_the_graders_work_off_the_main_thread():
  """Tunix scores rollouts in an executor thread, where math-verify's SIGALRM timeouts raise."""
  verdicts = []
  thread = threading.Thread(target=lambda: verdicts.extend(
      GRADERS[grader](completion, reference) for grader, completion, reference, *_ in CASES))
  thread.start()
  thread.join()
  assert verdicts == [bool(case[3]) for case in CASES]


def test_the_rewards_are_exactly_zero_or_one():
  number = [case for case in CASES if case[0] == "number"]
  rewards = grading.number_reward(["q"] * len(number), [case[1] for case in number],
                                  [case[2] for case in number])
  assert rewards == [float(case[3]) for case in number]
  assert all(type(reward) is float for reward in rewards)
  with pytest.raises(ValueError):  # one answer a completion
    grading.number_reward(["q"], ["1", "2"], ["1"])


def test_the_gsm8k_reference_is_the_number_after_the_hashes():
  assert grading.gsm8k_answer("48/2 = <<48/2=24>>24\n#### 1,200") == "1200"
  assert grading.gsm8k_answer("#### -7 ") == "-7"
  for bad in ("no final answer", "#### seven", "#### 3-5"):
    with pytest.raises(ValueError, match="#### <number>"):
      grading.gsm8k_answer(bad)


def test_a_math_grader_needs_a_process_and_a_deadline():
  with pytest.raises(ValueError, match="processes >= 1 and deadline_s > 0"):
    grading.MathGrader(processes=0)


@pytest.mark.slow
def test_the_math_grader_bounds_a_hang_and_grades_the_rest_in_any_thread():
  """Two worker processes grade the table's MATH cases and a tower of powers from a thread
  other than the main one: the tower is killed at its deadline and graded 0, its worker
  replaced, and every other case keeps its label."""
  math = [case for case in CASES if case[0] == "math"]
  completions = [case[1] for case in math] + [TOWER] + [case[1] for case in math]
  references = [case[2] for case in math] + ["1"] + [case[2] for case in math]
  results = {}
  with grading.MathGrader(processes=2, deadline_s=10.0) as grader:
    thread = threading.Thread(target=lambda: results.update(
        verdicts=grader(completions, references),
        rewards=grader.math_reward(["q"], ["\\boxed{\\frac12}", "\\boxed{2}"], ["0.5", "3"])))
    thread.start()
    thread.join()
    assert grader.failures == 1
  labels = [float(case[3]) for case in math]
  assert results["verdicts"].tolist() == labels + [0.0] + labels
  assert results["rewards"] == [1.0, 0.0]
  with pytest.raises(ValueError, match="closed"):
    grader(["1"], ["1"])
