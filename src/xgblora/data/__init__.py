"""Tasks (templates, verbalizers, metrics), data loading with MeZO's sampling protocol, and batching."""
