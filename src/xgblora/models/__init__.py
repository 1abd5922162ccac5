"""What a model is and computes, below any training: `pretrained` (load a model and tokenizer: hub id, folder, pkg:,
built-in random models; device and attention choice), `quant` (4-bit NF4 through bitsandbytes), `gguf` (GGUF files
read, dequantised once into a cached folder), `gguf_export` (a merged model written as one GGUF file) and `modelfile`
(its Ollama Modelfile), `scoring` (forwards: target log-probs, padded and packed, label logits), `sampler` (N
completions per prompt from one prompt forward, sharing its KV cache)."""
