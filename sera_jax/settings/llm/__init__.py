"""LLM post-training with Tunix; needs the `[llm]` extra (google-tunix).

See docs/method.md#llm-post-training.

* `learner`: MaxRL advantage estimators registered with Tunix, a policy loss
  normalised by the rollout budget, and `SeraLearner`, Tunix's GRPO learner
  with SERA's variable rollouts per prompt;
* `cluster`: the RLCluster those learners train (actor, optional reference, rollout);
* `tiny`: a digit-sum task and a 2-layer decoder that train on a CPU;
* `arithmetic`: multi-digit addition, the math task of `sera-jax figure math`;
* `config`: an experiment config's keys as `SeraConfig`'s fields;
* `gsm8k`: GSM8K with a pretrained Qwen3 or Qwen2 on an accelerator;
* `grading`: the graders of math answers (GSM8K's exact number, math-verify);
* `data`: problem files (GSM8K, MATH, POLARIS, benchmarks) as Parquet or JSONL;
* `evaluate`: a policy's pass@k, mean@n and greedy score (`sera-jax evaluate`).
"""
