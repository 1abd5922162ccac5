"""`xgblora eval` of a trained run (--adapter RUN/final, --model_name RUN) scores it on the run's own task, model
and head, as the run's own final evaluation did, and warns of an untrained head only where there is one."""

from __future__ import annotations

import json

import pytest

from xgblora import cli

UNTRAINED = "untrained head"


@pytest.fixture(scope="module")
def classifier_run(glue_data, tmp_path_factory):
    """A LoRA run of tiny-bert with a new classifier head (mean-pooled) on SST-2: the run's own accuracy."""
    out = tmp_path_factory.mktemp("cls") / "run"
    args = ["train", "--model_name", "tiny-bert", "--head", "classifier", "--pooling", "mean", "--task_name", "SST2",
            "--data_dir", str(glue_data), "--num_train", "16", "--num_eval", "16", "--max_steps", "3",
            "--max_length", "32", "--method", "lora", "--learning_rate", "1e-2", "--output_dir", str(out),
            "--device", "cpu"]
    assert cli.main(args) == 0
    return out, json.loads((out / "results.json").read_text())["accuracy"]


@pytest.mark.parametrize("given", [["--adapter", "{run}/final"], ["--model_name", "{run}"]], ids=["adapter", "run"])
def test_eval_of_a_classifier_run_takes_its_task_and_head(classifier_run, tmp_path, xgblora_log, capsys, given):
    run, accuracy = classifier_run
    args = ["eval", *(a.replace("{run}", str(run)) for a in given), "--output_dir", str(tmp_path / "eval"),
            "--device", "cpu"]
    assert cli.main(args) == 0, capsys.readouterr().err
    got = json.loads((tmp_path / "eval" / "results.json").read_text())
    model = str(run) if given[0] == "--model_name" else "tiny-bert"
    assert (got["task"], got["model"], got["head"], got["num_eval"]) == ("SST2", model, "classifier", 16)
    assert got["accuracy"] == accuracy  # the run's own final evaluation
    assert not [r for r in xgblora_log.records if UNTRAINED in r.getMessage()]


def test_eval_of_a_new_classifier_head_warns_it_is_untrained(glue_data, tmp_path, xgblora_log):
    args = ["eval", "--model_name", "tiny-bert", "--head", "classifier", "--task_name", "SST2", "--data_dir",
            str(glue_data), "--num_eval", "4", "--max_length", "32", "--output_dir", str(tmp_path / "eval"),
            "--device", "cpu"]
    assert cli.main(args) == 0
    assert len([r for r in xgblora_log.records if UNTRAINED in r.getMessage()]) == 1


def test_label_words_with_a_classifier_head_are_explained_once(tmp_path, xgblora_log):
    rows = "".join(json.dumps({"text": f"film {i}", "label": ["neg", "pos"][i % 2]}) + "\n" for i in range(4))
    (tmp_path / "t.jsonl").write_text(rows)
    args = ["eval", "--model_name", "tiny-bert", "--head", "classifier", "--task_name", "custom", "--eval_file",
            str(tmp_path / "t.jsonl"), "--template", "{text} It was", "--label_words", "terrible,great",
            "--label_names", "neg,pos", "--max_length", "16", "--output_dir", str(tmp_path / "out"), "--device", "cpu"]
    assert cli.main(args) == 0
    notices = [r.getMessage() for r in xgblora_log.records if "--label_words" in r.getMessage()]
    assert notices == ["--label_words with a classifier head: the words only count and name the labels (terrible, "
                       "great); the head learns one output per label and never reads them (--head lm or mlm scores "
                       "the words)"]


def test_eval_of_a_contrastive_run_through_its_final_adapter_embeds_and_scores_as_the_run(tmp_path):
    from test_embedding import TOPICS, pairs_file

    data, held = pairs_file(tmp_path / "pairs.jsonl"), tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"query": f"which one is {t}?", "positive": f"{t}, surely."}) + "\n"
                            for t in TOPICS[:6]), encoding="utf-8")
    run = tmp_path / "run"
    assert cli.main(["train", "--model_name", "tiny-bert", "--objective", "contrastive", "--query_instruction", "q: ",
                     "--pooling", "cls", "--max_length", "24", "--train_file", str(data), "--eval_file", str(held),
                     "--method", "lora", "--max_steps", "2", "--per_device_train_batch_size", "4",
                     "--save_strategy", "no", "--device", "cpu", "--output_dir", str(run)]) == 0
    assert cli.main(["eval", "--adapter", str(run / "final"), "--device", "cpu",
                     "--output_dir", str(tmp_path / "eval")]) == 0
    trained, got = (json.loads((folder / "results.json").read_text()) for folder in (run, tmp_path / "eval"))
    assert got["model"] == "tiny-bert" and got["num_eval"] == trained["num_eval"]
    assert {k: got[k] for k in ("recall@1", "mrr")} == {k: trained[k] for k in ("recall@1", "mrr")}
