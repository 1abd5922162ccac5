"""What a model is and computes, below any training: `pretrained` (load a model and tokenizer: hub id, folder, pkg:,
built-in random models; device and attention choice), `quant` (4-bit NF4 through bitsandbytes), `scoring` (forwards:
target log-probs, padded and packed, label logits, pooling for a classifier head), `sampler` (N completions per prompt
from one prompt forward, sharing its KV cache)."""
