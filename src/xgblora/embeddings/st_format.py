"""The files that make a saved model folder a sentence-transformers model: Transformer (the folder itself) ->
Pooling -> Normalize, with the pooling and instruction prompts the model was trained with; and what makes a saved
one-output sequence classifier a CrossEncoder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from xgblora.data.pairs import embedding_prefixes

_ST_POOLING = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "last": "pooling_mode_lasttoken"}


def write_sentence_transformers(out: Path, pooling: str, dim: int, max_length: int, query_prefix: str = "",
                                doc_prefix: str = "", include_prompt: bool = True) -> None:
    """Make a saved model folder a sentence-transformers model with the pooling it was trained with: Transformer
    (the folder itself) -> Pooling (include_prompt false: the prompt's tokens left out, as GRIT pools) -> Normalize;
    the instruction prefixes become its prompts "query"/"document"."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    pooling_config = {"word_embedding_dimension": dim, "pooling_mode_max_tokens": False,
                      "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
                      **{key: mode == pooling for mode, key in _ST_POOLING.items()}, "include_prompt": include_prompt}
    prompts = {name: text for name, text in (("query", query_prefix), ("document", doc_prefix)) if text}
    files = {"modules.json": modules, "1_Pooling/config.json": pooling_config,
             "sentence_bert_config.json": {"max_seq_length": max_length, "do_lower_case": False},
             "config_sentence_transformers.json": {"prompts": prompts, "default_prompt_name": None,
                                                   "similarity_fn_name": "cosine"}}
    (out / "1_Pooling").mkdir(parents=True, exist_ok=True)
    (out / "2_Normalize").mkdir(exist_ok=True)
    for name, value in files.items():
        (out / name).write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


# CrossEncoder's activation of a one-output model's logit, as it names it in the config it saves
CROSS_ENCODER_ACTIVATION = "torch.nn.modules.activation.Sigmoid"


def write_cross_encoder(out: Path, max_length: int) -> None:
    """Make a saved one-output sequence classifier and its tokenizer (config.json, tokenizer_config.json) a
    sentence-transformers CrossEncoder as it saves one: config.json names its activation (the sigmoid
    CrossEncoder.predict applies), and the tokenizer's model_max_length is the length the reranker was trained at,
    where CrossEncoder cuts its pairs."""
    for name, key, value in (("config.json", "sentence_transformers", {"activation_fn": CROSS_ENCODER_ACTIVATION}),
                             ("tokenizer_config.json", "model_max_length", max_length)):
        config = json.loads((out / name).read_text(encoding="utf-8"))
        config[key] = value
        (out / name).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def matryoshka_card(dims: str | None) -> str:
    """The model card's note of a Matryoshka model's sizes (--matryoshka_dims as given), '' for none:
    sentence-transformers' config has no field for them (its truncate_dim would cut every encoding by default)."""
    if not dims:
        return ""
    sizes = [int(d) for d in dims.replace(",", " ").split()]
    return (f"## Matryoshka embeddings\n\nTrained with sentence-transformers' MatryoshkaLoss at the sizes "
            f"matryoshka_dims: {sizes}. Load it cut to one of them with\n"
            f"`SentenceTransformer(path, truncate_dim={min(sizes)})`: the first {min(sizes)} dimensions of each "
            f"embedding.\n")


def embedding_export(out: Path, cfg: dict[str, Any], dim: int) -> None:
    """The sentence-transformers files of an embedding run's (config.yaml as a dict) saved model, and a Matryoshka
    model's card where the folder has none yet (a run's final/ gets the run's full card after this)."""
    prefixes = embedding_prefixes(cfg.get("instruction_format") or "plain", cfg.get("query_instruction") or "",
                                  cfg.get("doc_instruction") or "")
    write_sentence_transformers(out, cfg["pooling"], dim, int(cfg["max_length"]), prefixes.query, prefixes.doc,
                                cfg.get("include_prompt") is not False)
    card = matryoshka_card(cfg.get("matryoshka_dims"))
    if card and not (out / "README.md").exists():
        (out / "README.md").write_text(f"---\nlibrary_name: sentence-transformers\ntags: [xgblora, matryoshka]\n"
                                       f"---\n\n{card}", encoding="utf-8")
