"""The training commands, side by side over `train/`: `sft` (`xgblora train`, `eval` and `mezo`), `dpo`, `grpo`
and `rft` (rounds of sample -> verify -> train -> merge)."""
