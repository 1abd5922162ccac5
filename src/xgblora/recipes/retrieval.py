"""`xgblora eval --beir_dir DIR` (or --corpus_file, --queries_file, --qrels_file): a model, or a trained run as it
embeds, scored on a BEIR-format corpus as sentence-transformers' InformationRetrievalEvaluator scores it (see
evaluation/corpus.py), whole or at each --matryoshka_dims size. results.json holds the figures under the names that
evaluator gives them (cosine_ndcg@10; at a size, as its Matryoshka evaluators are named: dim_128_cosine_ndcg@10),
report.html their table."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import transformers

from xgblora.config import Config
from xgblora.data.beir import read_retrieval_set
from xgblora.data.pairs import embedding_prefixes
from xgblora.distributed import Distributed
from xgblora.evaluation import corpus
from xgblora.models import pretrained
from xgblora.recipes.lifecycle import Prepared
from xgblora.report import write_retrieval_report
from xgblora.train.setup import load_model, resolve_model, resolve_task_config

log = logging.getLogger("xgblora")


def prepare_retrieval(cfg: Config, files: tuple[Path, Path, Path], dist: Distributed) -> Prepared:
    """The model and the corpus, queries and qrels files (read and checked before the model loads), and the scoring
    that makes the run's results."""
    data = read_retrieval_set(*files)
    log.info("retrieval: %d queries with a relevant document, a corpus of %d documents (%s)", len(data.queries),
             len(data.corpus), files[2])
    transformers.set_seed(cfg.seed)
    cfg = resolve_model(cfg)
    head = pretrained.embedding_head(cfg.model_name, cfg.objective, cfg.trust_remote_code)
    model, tokenizer = load_model(cfg, dist, head)
    cfg = resolve_task_config(cfg, model, dist, head)

    def results() -> dict[str, Any]:
        started = time.perf_counter()
        dims = cfg.matryoshka[0] or (None,)
        prefixes = embedding_prefixes(cfg.instruction_format, cfg.query_instruction, cfg.doc_instruction)
        scored = corpus.evaluate(model, tokenizer, data, prefixes, dims, pooling=cfg.pooling,
                                 max_length=cfg.max_length, batch_size=cfg.per_device_eval_batch_size,
                                 bidirectional=bool(cfg.bidirectional), include_prompt=cfg.pools_prompt)
        names = {dim: "" if dim is None else f"dim_{dim}_" for dim in dims}
        done: dict[str, Any] = {
            "task": "retrieval", "adapter": cfg.adapter, "method": "none", "corpus_file": str(files[0]),
            "queries_file": str(files[1]), "qrels_file": str(files[2]), "num_queries": len(data.queries),
            "corpus_size": len(data.corpus), "eval_runtime_s": round(time.perf_counter() - started, 3),
            **{f"{names[dim]}cosine_{name}": value for dim, values in scored.items() for name, value in values.items()}}
        if dist.is_main:
            write_retrieval_report(Path(cfg.output_dir), done, {f"first {dim} dimensions" if dim else "whole": values
                                                                for dim, values in scored.items()})
        return done

    return Prepared(cfg, next(model.parameters()).device, None, results, data=str(files[0]))
