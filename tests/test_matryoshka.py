"""Matryoshka embeddings (`--matryoshka_dims`): the loss and its gradients equal sentence-transformers' MatryoshkaLoss
around MultipleNegativesRankingLoss and its cached variant, GRIT's embedding loss sums the sizes' losses, bad sizes
are refused in one line, and the exported model encodes cut to a size as sentence-transformers cuts it."""

import json

import pytest
import torch
from conftest import needs_minilm
from helpers import assert_same, grit_batch, grit_loss_and_grads, pair_batch
from test_embedding import TOPICS, minilm_triplets, pairs_file

from xgblora import cli
from xgblora.config import Config, check_ignored
from xgblora.embeddings.contrastive import Contrastive, info_nce
from xgblora.embeddings.pooling import embed
from xgblora.errors import UserError
from xgblora.models import pretrained
from xgblora.recipes.sft import run
from xgblora.train.objective import per_example_loss

DIMS, WEIGHTS = (384, 128, 64), (1.0, 0.5, 2.0)


def named_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}


@needs_minilm
@pytest.mark.parametrize("mini_batch", [0, 2])
def test_matryoshka_loss_and_gradients_equal_sentence_transformers(mini_batch):
    """mini_batch 0: MatryoshkaLoss(MultipleNegativesRankingLoss); 2: around CachedMultipleNegativesRankingLoss,
    whose cached embeddings it cuts inside the loss, as ours are."""
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer import losses

    model, batch, reference, features = minilm_triplets(st)
    ours = per_example_loss(model.eval(), batch, Contrastive("mean", 0.05, mini_batch=mini_batch, dims=DIMS,
                                                             dim_weights=WEIGHTS)).mean()
    ours.backward()
    inner = losses.CachedMultipleNegativesRankingLoss(reference, scale=20.0, mini_batch_size=mini_batch) \
        if mini_batch else losses.MultipleNegativesRankingLoss(reference, scale=20.0)
    theirs = losses.MatryoshkaLoss(reference, inner, list(DIMS), list(WEIGHTS))(features, None)
    theirs.backward()
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-5)
    got, expected = named_grads(model), named_grads(reference[0].auto_model)
    scale = max(float(g.abs().max()) for g in expected.values())
    assert got.keys() == expected.keys() and scale > 0
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-5 * scale)
    plain = per_example_loss(model, batch, Contrastive("mean", 0.05)).mean()
    assert abs(float(plain.detach()) - float(ours.detach())) > 1e-3  # the sizes changed the loss


def test_each_size_is_cut_before_it_is_normalised():
    model, tokenizer = pretrained.load("tiny-bert", head="embed")
    model.eval()
    batch = pair_batch(tokenizer, n=6)
    got = per_example_loss(model, batch, Contrastive("mean", 0.05, dims=(64, 16), dim_weights=(0.5, 3.0)))
    with torch.no_grad():
        q = embed(model, batch.query_ids, batch.query_mask, "mean", normalize=False)
        d = embed(model, batch.doc_ids, batch.doc_mask, "mean", normalize=False)

    def at(size: int) -> torch.Tensor:
        unit = [torch.nn.functional.normalize(x[:, :size], dim=-1) for x in (q, d)]
        return info_nce(*unit, batch.positive, batch.doc_key, 20.0)

    torch.testing.assert_close(got.detach(), 0.5 * at(64) + 3.0 * at(16), rtol=1e-5, atol=1e-6)


def test_grit_sums_the_sizes_embedding_losses_beside_its_generative_loss(tmp_path):
    """GRIT with sizes (H, 16) weighted (1, w): its plain loss plus w_c x w x the contrastive loss at 16; cached
    equal to the batch in one piece."""
    model, tokenizer = pretrained.load("tiny-llama")
    model.eval()
    batch = grit_batch(tokenizer, tmp_path)
    hidden, weights = model.config.hidden_size, (0.7, 0.5)

    def objective(**options) -> Contrastive:
        return Contrastive("last", 0.05, bidirectional=True, weights=weights, **options)

    with torch.no_grad():
        plain = per_example_loss(model, batch, objective())
        sized = per_example_loss(model, batch, objective(dims=(hidden, 16), dim_weights=(1.0, 2.0)))
        at_16 = per_example_loss(model, batch.pairs, objective(dims=(16,)))
    torch.testing.assert_close(sized, plain + weights[0] * 2.0 * at_16, rtol=1e-5, atol=1e-6)
    assert_same(grit_loss_and_grads(model, batch, objective(dims=(hidden, 16))),
                grit_loss_and_grads(model, batch, objective(dims=(hidden, 16), mini_batch=3)))


@pytest.mark.parametrize(("dims", "weights", "message"), [
    ("64,0", None, "'0' is not a positive whole number"),
    ("64,-16", None, "'-16' is not a positive whole number"),
    ("64,32.5", None, "'32.5' is not a positive whole number"),
    ("64,abc", None, "'abc' is not a positive whole number"),
    (" , ", None, "names no size"),
    ("64,32,64", None, "64 is given twice"),
    ("64,32", "1", "1 weights for 2"),
    ("64,32", "1,-0.5", "'-0.5' is not a weight of 0 or more"),
    ("64,32", "1,nan", "'nan' is not a weight"),
    (None, "1,1", "pass --matryoshka_dims too"),
])
def test_bad_sizes_and_weights_are_refused(dims, weights, message):
    with pytest.raises(UserError, match=message):
        Config(model_name="tiny-bert", objective="contrastive", train_file="pairs.jsonl", matryoshka_dims=dims,
               matryoshka_weights=weights)


def test_sizes_are_parsed_with_default_weights_and_refused_under_the_lm_objective():
    cfg = Config(model_name="tiny-bert", objective="grit", train_file="p.jsonl", grit_train_file="s.jsonl",
                 matryoshka_dims="64, 32,16")
    assert cfg.matryoshka == ((64, 32, 16), (1.0, 1.0, 1.0))
    with pytest.raises(UserError, match="--matryoshka_dims '64' does nothing here: an embedding option"):
        check_ignored(Config(task_name="SST2", matryoshka_dims="64"))
    with pytest.raises(UserError, match="--matryoshka_dims '64' does nothing here: nothing trains"):
        check_ignored(Config(model_name="tiny-bert", objective="contrastive", eval_file="p.jsonl", trainer="none",
                             matryoshka_dims="64", matryoshka_weights="1"))


def test_a_size_above_the_embedding_is_one_line_before_training(tmp_path, capsys, monkeypatch):
    data = pairs_file(tmp_path / "pairs.jsonl")
    code = cli.main(["train", "--model_name", "tiny-bert", "--objective", "contrastive", "--train_file", str(data),
                     "--matryoshka_dims", "128,64", "--max_steps", "1", "--device", "cpu",
                     "--output_dir", str(tmp_path / "out")])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # past the INFO lines
    assert code == 2 and len(errors) == 1
    assert errors[0].endswith("--matryoshka_dims 128,64: 128 is above tiny-bert's embedding size 64; give sizes of "
                              "at most 64")
    assert not (tmp_path / "out" / "final").exists()
    monkeypatch.setattr(pretrained, "load", lambda *a, **k: pytest.fail("a model loaded before the sizes' check"))
    code = cli.main(["train", "--model_name", "tiny-bert", "--objective", "contrastive", "--train_file", str(data),
                     "--matryoshka_dims", "64,0", "--output_dir", str(tmp_path / "bad")])
    assert code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_the_exported_model_encodes_cut_to_a_size_as_sentence_transformers_does(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    data = pairs_file(tmp_path / "pairs.jsonl", negatives=False)
    out = tmp_path / "run"
    run(Config(model_name="tiny-bert", objective="contrastive", train_file=str(data), num_train=8, method="ft",
               learning_rate=1e-3, max_steps=2, per_device_train_batch_size=4, max_length=32, output_dir=str(out),
               device="cpu", no_eval=True, matryoshka_dims="64,32,16", matryoshka_weights="1,1,0.5"))
    texts = [f"what about {t}?" for t in TOPICS]
    full = st.SentenceTransformer(str(out / "final"), device="cpu").encode(texts, convert_to_tensor=True)
    cut = st.SentenceTransformer(str(out / "final"), device="cpu", truncate_dim=16)
    assert cut.get_embedding_dimension() == 16
    torch.testing.assert_close(cut.encode(texts, convert_to_tensor=True), full[:, :16])
    # normalised as sentence-transformers normalises: after the cut, on request
    torch.testing.assert_close(cut.encode(texts, convert_to_tensor=True, normalize_embeddings=True),
                               torch.nn.functional.normalize(full[:, :16], dim=-1))
    card = (out / "final" / "README.md").read_text(encoding="utf-8")
    assert "matryoshka_dims: [64, 32, 16]" in card and "truncate_dim=16" in card
    assert json.loads((out / "final" / "config_sentence_transformers.json").read_text()).get("truncate_dim") is None


def test_a_merged_export_of_a_lora_run_names_the_sizes_in_its_card(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    data = pairs_file(tmp_path / "pairs.jsonl", negatives=False)
    run(Config(model_name="tiny-bert", objective="contrastive", train_file=str(data), num_train=8, method="lora",
               max_steps=1, per_device_train_batch_size=4, max_length=32, output_dir=str(tmp_path / "run"),
               device="cpu", no_eval=True, matryoshka_dims="64,16"))
    merged = tmp_path / "merged"
    assert cli.main(["export", str(tmp_path / "run"), "--format", "merged", "--output_dir", str(merged)]) == 0
    assert "matryoshka_dims: [64, 16]" in (merged / "README.md").read_text(encoding="utf-8")
    texts = [f"what about {t}?" for t in TOPICS[:4]]
    full = st.SentenceTransformer(str(merged), device="cpu").encode(texts, convert_to_tensor=True)
    cut = st.SentenceTransformer(str(merged), device="cpu", truncate_dim=16).encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(cut, full[:, :16])
