"""Adapters: the LoRA layer and its algebra (`lora`), XGBLoRA's boosting schedule (`boosting`), PEFT adapter folders
written and read (`peft`), and the one way in to a trained model for every command (`trained`: a base, a merged
folder, a PEFT adapter or a run folder, with the adapter applied)."""
