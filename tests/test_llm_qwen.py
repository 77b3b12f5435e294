"""GSM8K for a user with one accelerator: a train micro-batch that cannot fit the device is
refused before the first generation, and a tied-embedding Qwen3 checkpoint in Hugging Face
format with a Qwen tokenizer (<|endoftext|> its EOS and pad, turns ended by <|im_end|>) trains
a SERA step that stops at <|im_end|>, the config's stop token."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
import safetensors.numpy
from tiny_qwen import TINY, hf_checkpoint, save_tokenizer

from sera_jax.harness import configs
from sera_jax.settings.llm import cluster as cluster_lib
from sera_jax.settings.llm import config as llm_config
from sera_jax.settings.llm import gsm8k, tiny
from sera_jax.settings.llm import learner as sera_llm

TIED = dataclasses.replace(TINY, use_tied_embedding=True)


def test_a_cpu_reports_no_memory_limit_so_nothing_is_checked():
  assert sera_llm.device_memory_limit(jax.devices()) is None


@pytest.mark.slow
@pytest.mark.parametrize("limit", [None, 2**40, 2**16])
def test_a_micro_batch_that_cannot_fit_is_refused_before_generating(monkeypatch, limit):
  """Devices of 64 KiB cannot hold even the tiny decoder's weights, optimizer state and
  logits: refused at the first step, in one line, before any rollout; no limit reported
  (a CPU) or room enough: the step trains."""
  monkeypatch.setattr(sera_llm, "device_memory_limit", lambda devices: limit)
  learner = sera_llm.SeraLearner(
      tiny.cluster(1), sera_llm.SeraConfig(num_generations=tiny.BASELINE_N, n_max=tiny.N_MAX,
                                           dataset_size=tiny.DATASET_SIZE),
      tiny.slack_reward)
  generated = []
  generate = learner.rl_cluster.generate
  learner.rl_cluster.generate = lambda **kwargs: generated.append(1) or generate(**kwargs)
  with jax.set_mesh(tiny.mesh()):
    if limit == 2**16:
      with pytest.raises(ValueError, match=r"train micro-batch of 16 rollouts of 11 tokens "
                         r"needs at least .* GiB a device has: lower train_micro_batch_size"
                         ) as error:
        learner.train(tiny.dataset(1, tiny.BATCH_SIZE))
      assert "\n" not in str(error.value) and not generated
    else:
      learner.train(tiny.dataset(1, tiny.BATCH_SIZE))
      assert generated and learner.rl_cluster.actor_trainer.train_steps == 1


def _save_tied_checkpoint(directory) -> dict[str, np.ndarray]:
  """TIED's tensors under Hugging Face's Qwen3 names: no lm_head (the embedding is the output
  layer), and a final norm of 0, so every token is as likely as another (a policy that stops
  at <|im_end|> and at <|endoftext|> alike)."""
  tensors = hf_checkpoint(np.random.default_rng(0))
  del tensors["lm_head.weight"]
  tensors["model.norm.weight"] = np.zeros_like(tensors["model.norm.weight"])
  safetensors.numpy.save_file(tensors, str(directory / "model.safetensors"))
  return tensors


@pytest.mark.slow
def test_a_tied_qwen3_checkpoint_trains_a_sera_step_that_stops_at_im_end(tmp_path):
  _save_tied_checkpoint(tmp_path)
  save_tokenizer(tmp_path, eos_token="<|endoftext|>")
  config = configs.load("gsm8k_qwen3")
  config.update(model_dir=str(tmp_path), batch_size=4, baseline_n=4, n_max=8, num_steps=1,
                max_prompt_length=64, max_tokens_to_generate=128, kv_cache_size=192,
                generation_batch_size=16, train_micro_batch_size=2)
  mesh = gsm8k.make_mesh(config)
  model, tokenizer = gsm8k.load_pretrained(config, mesh, model_config=TIED)
  end_of_text, im_end = (tokenizer.encode(token)[0] for token in ("<|endoftext|>", "<|im_end|>"))
  assert tokenizer.eos_id() == tokenizer.pad_id() == end_of_text != im_end
  assert not hasattr(model, "lm_head")  # the embedding is the output layer
  stops = gsm8k.stop_ids(tokenizer, config.stop_tokens)
  assert stops == sorted([end_of_text, im_end])
  # As gsm8k.build_learner builds it, on four chat prompts instead of tfds gsm8k.
  cluster = cluster_lib.build(
      model, tokenizer, mesh, optimizer=optax.sgd(1e-3), max_steps=1,
      rollout_config=gsm8k.rollout_config(config, stops), batch_size=config.batch_size,
      train_micro_batch_size=config.train_micro_batch_size)
  learner = sera_llm.SeraLearner(cluster, llm_config.sera_config(config, dataset_size=4),
                                 _odd_length_reward)
  assert learner.forbidden == ()  # the pad id stops a rollout: nothing to forbid
  scored = []
  generate_and_score = learner.generate_and_score
  learner.generate_and_score = lambda *args: scored.append(generate_and_score(*args)) or \
      scored[-1]
  prompts = [tokenizer.tokenizer.apply_chat_template(
      [{"role": "user", "content": f"What is {a} + {b}?"}], tokenize=False,
      add_generation_prompt=True) for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
  with jax.set_mesh(mesh):
    learner.train([{"prompts": np.array(prompts), "idx": np.arange(4)}])
  assert learner.rl_cluster.actor_trainer.train_steps == 1
  (rollouts,) = scored
  ids = np.asarray(rollouts.example.completion_ids)
  last = np.array([ids[row, length - 1] for row, length in enumerate(rollouts.lengths)])
  # A rollout shorter than max_tokens_to_generate stopped, and trains the token it stopped at.
  assert np.isin(last[rollouts.lengths < config.max_tokens_to_generate], stops).all()
  assert (last == im_end).any() and (last == end_of_text).any(), last


def _odd_length_reward(prompts, completions, **unused) -> list[float]:
  return [float(len(completion) % 2) for completion in completions]
