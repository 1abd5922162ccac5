"""Data, before any model runs: rows from files (`sources`), MeZO's tasks and custom rows as Examples (`tasks`), pair
rows for embeddings (`pairs`), preference pairs (`preference`), a fixed label set's inputs for a classifier or
masked-LM head (`labels`), chat templates and loss masks (`formats`), MeZO's train/dev/eval sampling (`splits`),
tokenisation and collation (`collation`) into the typed batches (`batches`), and the resumable epoch order
(`order`)."""
