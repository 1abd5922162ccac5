"""The commands built on the sampler (`models/sampler.py`): `xgblora generate` (`generate`: prompts from a file,
completions to JSONL), `xgblora chat` (`chat`) and rejection-sampling fine-tuning (`rft`: rounds of sample ->
verify -> train -> merge)."""
