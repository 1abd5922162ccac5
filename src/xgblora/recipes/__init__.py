"""The training commands, side by side over `train/`, each run through one lifecycle (`lifecycle.run_recipe`):
`sft` (`xgblora train`, `eval` and `mezo`), `dpo`, `grpo` and `rft` (rounds of sample -> verify -> train ->
merge, each round's training an `sft` run)."""
