"""Evaluation, chosen once per run (`evaluators`): MeZO's candidate scoring with prompt KV caches (`candidates`),
instruction data (`instructions`), a classifier or masked-LM head (`labels`), embeddings (`retrieval`); and the one
module of answer extraction, normalisation and comparison that every grader uses (`answers`)."""
