"""Embedding models: pooled, normalised embeddings and the bidirectional mask (`pooling`), `xgblora encode`
(`encode`), and the files that make a saved model a sentence-transformers model (`st_format`)."""
