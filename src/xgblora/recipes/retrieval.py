"""`xgblora eval --beir_dir DIR` (or --corpus_file, --queries_file, --qrels_file): a model, or a trained run as it
embeds, scored on a BEIR-format corpus as sentence-transformers' InformationRetrievalEvaluator scores it (see
evaluation/corpus.py), whole or at each --matryoshka_dims size, or cut to --truncate_dim alone (as
SentenceTransformer(model, truncate_dim=K) embeds). results.json holds the figures under the names that evaluator
gives them (cosine_ndcg@10; at a size, as its Matryoshka evaluators are named: dim_128_cosine_ndcg@10), report.html
their table. With --reranker, a cross-encoder then reranks each query's --rerank_top_k best documents of one
first-stage ranking, the whole embedding's (a Matryoshka model's too) or --truncate_dim's, scored as
CrossEncoderRerankingEvaluator scores them (evaluation/reranking.py), its figures named as that evaluator names
them under the name rerank: rerank_ndcg@10 after, rerank_base_ndcg@10 before."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import transformers
from torch import nn

from xgblora.adapters import trained
from xgblora.config import Config
from xgblora.data.beir import RetrievalSet, read_retrieval_set
from xgblora.data.pairs import embedding_prefixes
from xgblora.distributed import Distributed
from xgblora.embeddings.rerank import score_pairs
from xgblora.errors import UserError
from xgblora.evaluation import corpus, reranking
from xgblora.models import pretrained
from xgblora.recipes.lifecycle import Prepared
from xgblora.report import write_retrieval_report
from xgblora.train.setup import load_model, resolve_model, resolve_task_config

log = logging.getLogger("xgblora")


def prepare_retrieval(cfg: Config, files: tuple[Path, Path, Path], dist: Distributed) -> Prepared:
    """The model and the corpus, queries and qrels files (read and checked before the model loads), the reranker
    where one is named, and the scoring that makes the run's results."""
    data = read_retrieval_set(*files)
    log.info("retrieval: %d queries with a relevant document, a corpus of %d documents (%s)", len(data.queries),
             len(data.corpus), files[2])
    transformers.set_seed(cfg.seed)
    cfg = resolve_model(cfg)
    head = pretrained.embedding_head(cfg.model_name, cfg.objective, cfg.trust_remote_code)
    model, tokenizer = load_model(cfg, dist, head)
    cfg = resolve_task_config(cfg, model, dist, head)
    check_truncate_dim(cfg, model)
    rerank = reranking_of(cfg, dist, data) if cfg.reranker is not None else None

    def results() -> dict[str, Any]:
        started = time.perf_counter()
        # the sizes scored; the reranker's first stage is one ranking: --truncate_dim's, else the whole embedding's
        dims = (cfg.truncate_dim,) if cfg.truncate_dim else cfg.matryoshka[0] or (None,)
        stage = cfg.truncate_dim
        searched = (*dims, stage) if rerank is not None and stage not in dims else dims
        prefixes = embedding_prefixes(cfg.instruction_format, cfg.query_instruction, cfg.doc_instruction)
        hits = corpus.search(model, tokenizer, data, prefixes, searched, depth=max(corpus.MAX_K, cfg.rerank_top_k),
                             pooling=cfg.pooling, max_length=cfg.max_length, batch_size=cfg.per_device_eval_batch_size,
                             bidirectional=bool(cfg.bidirectional), include_prompt=cfg.pools_prompt)
        scored = corpus.figures_of(data, {dim: hits[dim] for dim in dims})
        names = {dim: "" if dim is None else f"dim_{dim}_" for dim in dims}
        reranked = rerank(hits[stage]) if rerank is not None else {}
        done: dict[str, Any] = {
            "task": "retrieval", "adapter": cfg.adapter, "method": "none", "corpus_file": str(files[0]),
            "queries_file": str(files[1]), "qrels_file": str(files[2]), "num_queries": len(data.queries),
            "corpus_size": len(data.corpus), **({"truncate_dim": cfg.truncate_dim} if cfg.truncate_dim else {}),
            **({"reranker": cfg.reranker, "rerank_top_k": cfg.rerank_top_k} if rerank is not None else {}),
            "eval_runtime_s": round(time.perf_counter() - started, 3),
            **{f"{names[dim]}cosine_{name}": value for dim, values in scored.items() for name, value in values.items()},
            **{f"rerank_{name}": value for name, value in reranked.items()}}
        if dist.is_main:
            write_retrieval_report(Path(cfg.output_dir), done, {f"first {dim} dimensions" if dim else "whole": values
                                                                for dim, values in scored.items()},
                                   _reranking_table(cfg, reranked))
        return done

    return Prepared(cfg, next(model.parameters()).device, None, results, data=str(files[0]))


def check_truncate_dim(cfg: Config, model: nn.Module) -> None:
    """--truncate_dim within the model's embedding size, refused before the corpus is embedded."""
    size = getattr(model.config, "hidden_size", None)
    if cfg.truncate_dim is not None and size is not None and cfg.truncate_dim > size:
        raise UserError(f"--truncate_dim {cfg.truncate_dim} is above {cfg.model_name}'s embedding size {size}; "
                        f"give at most {size}")


def reranking_of(cfg: Config, dist: Distributed, data: RetrievalSet) -> Callable[[list[list[str]]], dict[str, float]]:
    """The reranker of --reranker, loaded, and what reranks the first stage's ranked ids of each query with it:
    the reranking figures (`reranking.rerank`) of each query's --rerank_top_k best documents."""
    model, tokenizer, max_length = load_reranker(cfg, dist)

    def score(pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        return score_pairs(model, tokenizer, pairs, max_length, cfg.per_device_eval_batch_size).numpy()

    def rerank(hits: list[list[str]]) -> dict[str, float]:
        samples = [reranking.RerankSample(text, tuple(data.corpus[d] for d in sorted(data.relevant[query])),
                                    tuple(data.corpus[d] for d in ids[:cfg.rerank_top_k]), ranked=True)
                   for (query, text), ids in zip(data.queries.items(), hits, strict=True)]
        return reranking.rerank(samples, score, cfg.always_rerank_positives)

    return rerank


def load_reranker(cfg: Config, dist: Distributed) -> tuple[nn.Module, Any, int]:
    """The cross-encoder of --reranker (a rerank run, a CrossEncoder or sequence-classifier folder, a hub id,
    pkg:), its tokenizer, and the length it reads pairs at: its run's --max_length, else its sentence-transformers
    max_seq_length, else its tokenizer's, within its positions."""
    settings = trained.run_options(cfg.reranker)
    if settings and settings.get("objective") != "rerank":
        raise UserError(f"--reranker {cfg.reranker}: an xgblora run of --objective {settings.get('objective', 'lm')}; "
                        f"a reranker is trained with --objective rerank")
    device = pretrained.choose_device(dist.device or cfg.device)
    model, tokenizer = trained.load_model(trained.resolve(cfg.reranker), dtype=cfg.dtype_name, device=str(device),
                                          attn_implementation=cfg.attn_implementation,
                                          trust_remote_code=cfg.trust_remote_code, head="classifier")
    if model.config.num_labels != 1:
        raise UserError(f"--reranker {cfg.reranker}: a classifier of {model.config.num_labels} labels; a reranker "
                        f"gives one score per (query, passage) pair (an xgblora rerank run, or a CrossEncoder)")
    length = (settings or pretrained.sentence_settings(cfg.reranker)).get("max_length", tokenizer.model_max_length)
    positions = getattr(model.config, "max_position_embeddings", None)
    return model, tokenizer, min(length, positions) if positions else length


def _reranking_table(cfg: Config, reranked: dict[str, float]) -> dict[str, dict[str, float]]:
    """The report's reranking rows: the first stage's top k, then reranked ({} without a reranker)."""
    if not reranked:
        return {}
    names = [name for name in reranked if not name.startswith("base_")]
    stage = f"first {cfg.truncate_dim} dimensions" if cfg.truncate_dim else "whole embedding"
    return {f"first stage ({stage}), top {cfg.rerank_top_k}": {name: reranked[f"base_{name}"] for name in names},
            f"reranked by {Path(cfg.reranker).name or cfg.reranker}": {name: reranked[name] for name in names}}
