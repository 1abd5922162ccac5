"""Embedding models: the contrastive objective (`contrastive`: InfoNCE, GRIT's weights), pooled and normalised
embeddings and the bidirectional mask (`pooling`), a batch embedded in length-sorted pieces (`pieces`) or by
gradient caching (`gradcache`), `xgblora encode` (`encode`), `xgblora mine` (`mine`), and the files that make a saved
model a sentence-transformers model (`st_format`)."""
