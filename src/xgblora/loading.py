"""A trained model ready for inference, whatever form it was saved in."""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from xgblora import models


def load_for_inference(name_or_path: str, adapter: str | None = None, *, dtype: str = "float32", device: str = "cpu",
                       attn_implementation: str = "auto", trust_remote_code: bool = False,
                       load_in_4bit: bool = False) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A causal LM and its tokenizer, in eval mode."""
    if adapter is not None or load_in_4bit:
        raise NotImplementedError("adapters and 4-bit bases are loaded by the adapters branch")
    model, tokenizer = models.load(name_or_path, dtype=dtype, attn_implementation=attn_implementation,
                                   device=device, trust_remote_code=trust_remote_code)
    return model.eval(), tokenizer
