"""xgblora: gradient-boosted rank-1 LoRA (XGBLoRA), LoRA and full fine-tuning with AdamW or MeZO."""

__version__ = "0.1.0"
