"""`sera-jax evaluate`: pass@k from a correctness matrix against every k-subset, the output
files, the benchmark and checkpoint arguments, and the command end to end on a tiny Qwen3
whose pass@k CSV is recomputed here from the samples it saved."""

import csv
import dataclasses
import itertools
import json
import math

import jax
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from tiny_qwen import TINY, byte_vocabulary, hf_checkpoint, save_tokenizer
from tunix.models.qwen3 import model as qwen3
from tunix.sft import checkpoint_manager

from sera_jax.harness import cli, configs
from sera_jax.settings.llm import evaluate, gsm8k

DIGITS = "0123"  # the only digits the tiny model below writes often


def brute_pass_at_k(correct: np.ndarray, k: int) -> float:
  """The mean over problems of the fraction of k-subsets of a problem's samples holding a right
  one: what the unbiased estimator estimates, by enumeration."""
  n = correct.shape[1]
  return float(np.mean([np.mean([row[list(subset)].any()
                                  for subset in itertools.combinations(range(n), k)])
                        for row in correct]))


@pytest.mark.parametrize("n", range(1, 7))
def test_pass_at_k_of_a_matrix_is_the_mean_over_k_subsets(n):
  rng = np.random.default_rng(n)
  correct = rng.random((5, n)) < rng.random((5, 1))  # problems of every difficulty
  greedy = rng.random(5) < 0.5
  row = evaluate.scores(correct, greedy)
  assert (row["problems"], row["samples"], row["greedy"]) == (5, n, np.mean(greedy))
  assert row[f"mean@{n}"] == pytest.approx(np.mean(correct), abs=1e-15)
  assert [key for key in row if key.startswith("pass@")] == [f"pass@{k}" for k in
                                                            evaluate.ks(n)]
  for k in evaluate.ks(n):
    assert row[f"pass@{k}"] == pytest.approx(brute_pass_at_k(correct, k), abs=1e-12)
  assert "greedy" not in evaluate.scores(correct)


def test_the_ks_are_the_powers_of_two_up_to_n_and_n():
  assert evaluate.ks(1) == [1]
  assert evaluate.ks(6) == [1, 2, 4, 6]
  assert evaluate.ks(16) == [1, 2, 4, 8, 16]


def test_the_outputs_are_the_rows_their_plot_and_the_samples(tmp_path):
  rows = [{"benchmark": name, **evaluate.scores(np.eye(2, 4, dtype=bool), np.array([1, 0]))}
          for name in ("gsm8k", "aime25")]
  samples = [{"benchmark": "gsm8k", "problem": 0, "sample": 0, "greedy": False,
              "reference": "3", "completion": "x = 3", "correct": True}]
  evaluate.write_results(tmp_path / "out", rows, samples, title="tiny")
  with open(tmp_path / "out" / evaluate.CSV) as stream:
    written = list(csv.DictReader(stream))
  assert [row["benchmark"] for row in written] == ["gsm8k", "aime25"]
  assert {key: float(value) for key, value in written[0].items() if key != "benchmark"} == (
      pytest.approx({"problems": 2, "samples": 4, "greedy": 0.5, "mean@4": 0.25, "pass@1": 0.25,
                     "pass@2": 0.5, "pass@4": 1.0}, abs=1e-15))
  lines = (tmp_path / "out" / evaluate.SAMPLES).read_text().splitlines()
  assert [json.loads(line) for line in lines] == samples
  assert (tmp_path / "out" / evaluate.PLOT).read_bytes().startswith(b"\x89PNG")


def test_a_benchmark_is_a_format_and_a_path_and_maybe_a_name():
  assert evaluate.parse_benchmark("math=/data/math500/test.jsonl") == (
      "test", "math", "/data/math500/test.jsonl")
  assert evaluate.parse_benchmark("aime25:math=gs://bucket/aime25/test.jsonl") == (
      "aime25", "math", "gs://bucket/aime25/test.jsonl")
  for bad in ("math", "math=", "/data/test.jsonl"):
    with pytest.raises(ValueError, match=r"\[NAME:\]FORMAT=PATH"):
      evaluate.parse_benchmark(bad)


@pytest.mark.parametrize("argv, message", [
    ([], "give at least one benchmark"),
    (["--data", "maths=x.jsonl"], "format must be one of"),
    (["--data", "math=absent.jsonl"], "no problem file absent.jsonl"),
    (["--data", "math=x.jsonl", "--samples=0"], "samples"),
    (["--data", "math=x.jsonl", "--config.temperature=0"], "config.temperature must be > 0"),
    (["--data", "math=x.jsonl", "--config.batch_sise=8"], "batch_sise"),
    (["--data", "math=x.jsonl", "--config", "maze"], "an LLM config .* got task 'maze'"),
])
def test_the_command_refuses_a_bad_argument_before_it_loads_a_model(argv, message):
  with pytest.raises(SystemExit, match=message):
    cli.main(["evaluate", *argv])


def test_the_command_has_a_help(capsys):
  cli.main(["evaluate", "--help"])
  out = capsys.readouterr().out
  assert out.startswith("usage:\n  sera-jax evaluate") and "--grading_deadline" in out


def _model_dir(directory, rng: np.random.Generator) -> str:
  """A tiny random Qwen3 that mostly writes one of DIGITS first, with the byte tokenizer.

  The output head's rows of DIGITS are 4 (+-e0 +-e1) and every other row is 0, so whatever
  the final hidden state h, some digit's logit is 4 (|h0| + |h1|) > 0: which one depends on
  the prompt, and so does how sure the model is of it.
  """
  tensors = hf_checkpoint(rng)
  head = np.zeros_like(tensors["lm_head.weight"])
  vocabulary = byte_vocabulary()
  for digit, (sign0, sign1) in zip(DIGITS, itertools.product((1, -1), repeat=2), strict=True):
    head[vocabulary[digit], :2] = (4 * sign0, 4 * sign1)
  tensors["lm_head.weight"] = head
  directory.mkdir()
  safetensors.numpy.save_file(tensors, str(directory / "model.safetensors"))
  save_tokenizer(directory)
  return str(directory)


def _config_argv(model_dir: str) -> list[str]:
  """The shipped gsm8k_qwen3 config shrunk to one new token a completion."""
  return ["--config", "gsm8k_qwen3", f"--config.model_dir={model_dir}",
          "--config.max_prompt_length=256", "--config.max_tokens_to_generate=1",
          "--config.kv_cache_size=264", "--config.generation_batch_size=8"]


@pytest.fixture
def tiny_preset(monkeypatch):
  """The config's model preset is the tiny Qwen3, rematerialised as training's model is."""
  monkeypatch.setattr(gsm8k, "preset_config", lambda config: dataclasses.replace(
      TINY, remat_config=qwen3.RematConfig.DECODER))


def _write_jsonl(path, rows) -> str:
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))
  return str(path)


@pytest.mark.slow
def test_the_command_end_to_end_matches_the_estimator_recomputed_from_its_samples(
    tmp_path, tiny_preset, capsys):
  """A GSM8K-format and a MATH-format benchmark of 6 problems each, 4 samples and a greedy
  completion a problem: each saved verdict is the completion's equality with the reference,
  and the CSV's pass@k, mean@4 and greedy accuracy are those of the saved verdicts."""
  model_dir = _model_dir(tmp_path / "model", np.random.default_rng(0))
  references = [DIGITS[i % len(DIGITS)] for i in range(6)]
  gsm = _write_jsonl(tmp_path / "gsm.jsonl", [
      {"question": f"How many pens are left after sale {i}?", "answer": f"...\n#### {ref}"}
      for i, ref in enumerate(references)])
  math_file = _write_jsonl(tmp_path / "math.jsonl", [
      {"problem": f"What is ${i} \\bmod 4$?", "answer": ref} for i, ref in enumerate(references)])
  out = tmp_path / "eval"
  cli.main(["evaluate", *_config_argv(model_dir), "--data", f"gsm8k={gsm}",
            "--data", f"mod4:math={math_file}", "--samples=4", f"--out={out}",
            "--grading_processes=1"])
  assert capsys.readouterr().out.endswith(f"outputs in {out}\n")

  records = [json.loads(line) for line in (out / evaluate.SAMPLES).read_text().splitlines()]
  assert len(records) == 2 * 6 * (4 + 1)
  for record in records:  # one new token: right exactly when it is the reference digit
    assert record["correct"] == (record["completion"] == record["reference"]), record
  with open(out / evaluate.CSV) as stream:
    rows = {row["benchmark"]: row for row in csv.DictReader(stream)}
  assert list(rows) == ["gsm", "mod4"]
  for name, row in rows.items():
    sampled = [r for r in records if r["benchmark"] == name and not r["greedy"]]
    assert [(r["problem"], r["sample"]) for r in sampled] == list(
        itertools.product(range(6), range(4)))
    correct = np.array([r["correct"] for r in sampled]).reshape(6, 4)
    successes = correct.sum(axis=1)
    assert 0 < successes.sum() < correct.size  # the estimator sees both outcomes
    for k in (1, 2, 4):
      want = np.mean([1 - math.comb(4 - c, k) / math.comb(4, k) for c in successes])
      assert float(row[f"pass@{k}"]) == pytest.approx(want, abs=1e-12), (name, k)
    assert float(row["mean@4"]) == pytest.approx(correct.mean(), abs=1e-12)
    greedy = [r["correct"] for r in records if r["benchmark"] == name and r["greedy"]]
    assert len(greedy) == 6 and float(row["greedy"]) == pytest.approx(np.mean(greedy))
    assert (row["problems"], row["samples"], row["checkpoint_step"]) == ("6", "4", "pretrained")
    assert row["grading_failures"] == "0"
  assert (out / evaluate.PLOT).exists()


@pytest.mark.slow
def test_a_trained_checkpoint_replaces_the_pretrained_weights(tmp_path, tiny_preset):
  """config.checkpoint_dir's actor (as Tunix's RLCluster saves it, under actor/) is what is
  evaluated: its latest step or the one asked for; a step it lacks is refused."""
  config = configs.load("gsm8k_qwen3")
  config.model_dir = _model_dir(tmp_path / "model", np.random.default_rng(0))
  mesh = gsm8k.make_mesh(config)
  with pytest.raises(ValueError, match="set config.checkpoint_dir"):
    evaluate.load_policy(config, mesh, step=2)
  config.checkpoint_dir = str(tmp_path / "run")
  with pytest.raises(FileNotFoundError, match=r"holds no checkpoint of the actor \(its steps: "
                                              r"none\)"):
    evaluate.load_policy(config, mesh)
  trained, _ = gsm8k.load_pretrained(config, mesh)
  saver = checkpoint_manager.CheckpointManager(str(tmp_path / "run" / "actor"))
  for step, scale in ((1, 2.0), (3, 3.0)):
    nnx.update(trained, jax.tree.map(lambda x, s=scale: x * s, nnx.state(trained, nnx.Param)))
    saver.save(step, trained, force=True)
  saver.close()
  pretrained, _ = gsm8k.load_pretrained(config, mesh)
  head = np.asarray(pretrained.lm_head.w[...])
  for step, scale in ((None, 6.0), (1, 2.0), (3, 6.0)):
    model, _, restored = evaluate.load_policy(config, mesh, step=step)
    assert restored == (3 if step is None else step)
    np.testing.assert_allclose(np.asarray(model.lm_head.w[...]), scale * head, rtol=1e-6)
  with pytest.raises(FileNotFoundError, match=r"at step 2 \(its steps: \[1, 3\]\)"):
    evaluate.load_policy(config, mesh, step=2)
