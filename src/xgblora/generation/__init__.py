"""The commands built on the sampler (`models/sampler.py`): `xgblora generate` (`generate`: prompts from a file,
completions to JSONL), `xgblora chat` (`chat`), rejection-sampling fine-tuning (`rft`: rounds of sample -> verify ->
train -> merge), GRPO (`grpo`: the command and its loop; `grpo_objective`: advantages, the clipped loss, the KL, as TRL
computes them) and the reward functions it calls (`rewards`)."""
