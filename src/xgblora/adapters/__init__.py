"""Adapters: LoRA layers, XGBLoRA boosting schedule, and export to PEFT or a merged model."""
