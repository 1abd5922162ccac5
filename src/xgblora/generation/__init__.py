"""What is built on the sampler (`models/sampler.py`): `xgblora generate` (`generate`: prompts from a file,
completions to JSONL), `xgblora chat` (`chat`), and GRPO's parts: its rollout (`rollout`: sample, score, advantages,
log-probabilities), its batch source over it (`grpo_batches`), its objective (`grpo_objective`: advantages, the
clipped loss, the KL, as TRL computes them) and the reward functions it calls (`rewards`). The grpo and rft commands
are in `recipes/`."""
