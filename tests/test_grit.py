"""GRIT on a tiny Llama: the embedding pass really attends both ways, a run lowers both of its losses, and its
merged export embeds (as the run does) and generates."""

import json

import numpy as np
import pytest
import torch
import yaml

from xgblora import cli
from xgblora.config import Config
from xgblora.data import formats
from xgblora.data.pairs import Prefixes, collate_pairs, gritlm_instruction, pair_seqs, prefix_length
from xgblora.data.splits import load_rows
from xgblora.data.tasks import CustomTask, Example
from xgblora.embeddings.contrastive import Contrastive
from xgblora.embeddings.pooling import bidirectional_supported, embed, encode_texts, hidden_states
from xgblora.errors import UserError
from xgblora.models import pretrained
from xgblora.recipes.sft import run
from xgblora.train import setup
from xgblora.train.objective import grit_training_set, per_example_loss, sequence_training_set

TOPICS = ["the movie was a love story", "a film about the war", "the best story of the year", "a boring time",
          "funny and good", "the terrible acting", "a great new film", "what a fun movie", "the dull plot",
          "a story of love and time"]


def test_the_bidirectional_mask_lets_earlier_tokens_see_later_ones_and_still_hides_padding():
    model, _ = pretrained.load("tiny-llama")
    model.eval()
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    changed = ids.clone()
    changed[0, -1] = 123
    mask = torch.ones_like(ids)
    with torch.no_grad():
        for bidirectional in (False, True):
            first = [hidden_states(model, x, mask, bidirectional)[0, 0] for x in (ids, changed)]
            assert torch.allclose(first[0], first[1]) != bidirectional
        # a right-padded row: its real tokens' states are those of the row alone (padding is masked both ways)
        padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], 1)
        padded_mask = torch.cat([mask, torch.zeros(1, 3, dtype=torch.long)], 1)
        alone = hidden_states(model, ids, mask, True)
        torch.testing.assert_close(hidden_states(model, padded, padded_mask, True)[:, :5], alone, rtol=1e-4,
                                   atol=1e-5)
    assert bidirectional_supported(model)


def query(i: int) -> str:
    return f"what about {TOPICS[i]}?"


def positive(i: int) -> str:
    """A document that shares no topic words with its query (a random model cannot match them by overlap)."""
    return f"{TOPICS[(i + 3) % len(TOPICS)]}, they said."


def write_data(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"query": query(i), "positive": positive(i)}) + "\n"
                             for i in range(len(TOPICS))), encoding="utf-8")
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"Question: is {t} good?\nAnswer:", "completion": " Yes, great."})
                           + "\n" for t in TOPICS), encoding="utf-8")
    return pairs, sft


def losses(model, tokenizer, cfg: Config, pairs, sft) -> tuple[float, float]:
    """Contrastive and generative loss of the whole training data (both as the run computes them)."""
    examples = [Example(query(i), (positive(i),), (0,)) for i in range(len(TOPICS))]
    batch = collate_pairs(pair_seqs(tokenizer, examples, cfg.max_length), tokenizer.pad_token_id)
    task = CustomTask(Config(task_name="custom", train_file=str(sft)).data)
    seqs = formats.instruction_seqs(tokenizer, load_rows(task, "train", None), cfg.max_length, False,
                                    formats.stop_token_ids(tokenizer))
    generative = sequence_training_set(seqs, tokenizer.pad_token_id, token_mean=True).batch(range(len(seqs)))
    with torch.no_grad():
        model.eval()
        contrastive = per_example_loss(model, batch, Contrastive(cfg.pooling, cfg.similarity_temperature, False, True)).mean()
        return float(contrastive), float(per_example_loss(model, generative).mean())


def test_grit_lowers_both_losses_and_its_merged_export_embeds_and_generates(tmp_path):
    pairs, sft = write_data(tmp_path)
    out = tmp_path / "run"
    results = run(Config(model_name="tiny-llama", objective="grit", train_file=str(pairs), grit_train_file=str(sft),
                         instruction_format="gritlm", query_instruction="Find a review of another film",
                         eval_file=str(pairs), num_train=8, num_dev=2, method="lora", learning_rate=3e-3,
                         max_steps=24, per_device_train_batch_size=4, max_length=48, evaluation_strategy="steps",
                         eval_steps=12,
                         output_dir=str(out), device="cpu", lora_target_modules="all-linear"))
    cfg = Config(**{k: v for k, v in yaml.safe_load((out / "config.yaml").read_text()).items()})
    assert cfg.bidirectional is True and cfg.pooling == "mean"  # GRIT's default where the model allows it
    assert cfg.include_prompt is False and cfg.contrastive_temperature == 0.02  # GritLM's pooling and temperature
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "eval_recall@1" in line]
    assert [e["step"] for e in evals] == [12, 24] and "recall@1" in results

    merged = tmp_path / "merged"
    assert cli.main(["export", str(out), "--format", "merged", "--output_dir", str(merged)]) == 0
    base, tokenizer = pretrained.load("tiny-llama")
    trained, merged_tokenizer = pretrained.load(str(merged))
    before, after = losses(base, tokenizer, cfg, pairs, sft), losses(trained, merged_tokenizer, cfg, pairs, sft)
    assert after[0] < before[0] * 0.9 and after[1] < before[1] * 0.9, (before, after)

    # it embeds: `xgblora encode` of the run (adapter merged in memory) equals the merged export's embeddings
    vectors = tmp_path / "q.safetensors"
    assert cli.main(["encode", str(out), "--input", str(pairs), "--column", "query", "--output", str(vectors)]) == 0
    from safetensors.torch import load_file

    queries = [json.loads(line)["query"] for line in pairs.read_text().splitlines()]
    prefix = gritlm_instruction("Find a review of another film")
    exported = encode_texts(trained, merged_tokenizer, queries, pooling="mean", max_length=48, bidirectional=True,
                            prefix=prefix, include_prompt=False)
    torch.testing.assert_close(load_file(vectors)["embeddings"], exported, rtol=1e-4, atol=1e-5)
    # sentence-transformers loads the export and embeds the same: its "query" prompt left out of the pooling
    # (include_prompt false), the model attending both ways (transformers' is_causal=False)
    st = pytest.importorskip("sentence_transformers")
    pooling_config = json.loads((merged / "1_Pooling" / "config.json").read_text())
    assert pooling_config["include_prompt"] is False
    reference = st.SentenceTransformer(str(merged), device="cpu")
    reference[0].auto_model.config.is_causal = False
    theirs = reference.encode(queries, prompt_name="query", convert_to_tensor=True)
    torch.testing.assert_close(theirs, exported, rtol=1e-4, atol=1e-5)
    assert np.allclose(torch.linalg.norm(exported, dim=1).numpy(), 1.0, atol=1e-5)
    # and generates: greedy continuations of a training prompt, from the merged weights with the KV cache
    prompt = merged_tokenizer("Question: is a boring time good?\nAnswer:", return_tensors="pt")
    generated = trained.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 4 or generated[0, -1] in formats.stop_token_ids(
        merged_tokenizer)


def test_grit_needs_a_causal_lm_and_instruction_data(tmp_path):
    pairs, chat = write_data(tmp_path)
    with pytest.raises(Exception, match="encoder"):
        run(Config(model_name="tiny-bert", objective="grit", train_file=str(pairs), grit_train_file=str(chat),
                   num_train=4, max_steps=1, output_dir=str(tmp_path / "a")))
    with pytest.raises(Exception, match="--grit_train_file"):
        Config(model_name="tiny-llama", objective="grit", train_file=str(pairs), num_train=4, max_steps=1,
               output_dir=str(tmp_path / "b"))


def test_grit_pooling_leaves_the_instruction_out_as_gritlm_does():
    """GritLM's encode (ContextualAI/gritlm, gritlm.py): the instruction + text tokenised right-padded, a
    bidirectional pass (here transformers' own, is_causal=False), the instruction's tokens zeroed in the pooling
    mask, the masked mean, normalised."""
    model, tokenizer = pretrained.load("tiny-llama")
    model.eval()
    instruction = gritlm_instruction("Retrieve a review of the same film")
    texts = ["a film about the war", "funny", "the best story of the year, they said"]
    ours = encode_texts(model, tokenizer, texts, pooling="mean", max_length=64, bidirectional=True,
                        prefix=instruction, include_prompt=False)
    with_instruction = encode_texts(model, tokenizer, texts, pooling="mean", max_length=64, bidirectional=True,
                                    prefix=instruction)

    tokenizer.padding_side = "right"
    inputs = tokenizer([instruction + t for t in texts], padding=True, return_tensors="pt")
    model.config.is_causal = False
    with torch.no_grad():
        hidden = model.model(**inputs).last_hidden_state
    mask = inputs["attention_mask"].clone()
    mask[:, :len(tokenizer(instruction)["input_ids"])] = 0
    s = torch.sum(hidden * mask.unsqueeze(-1).float(), dim=1)
    reference = torch.nn.functional.normalize(s / mask.sum(dim=1, keepdim=True).float(), dim=-1)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-5)
    assert (ours - with_instruction).abs().max() > 1e-3  # pooling the instruction in is another embedding


def test_the_contrastive_loss_pools_as_encoding_does():
    """Training's embeddings (Contrastive with the prefixes' lengths) equal encode_texts' without the instruction."""
    model, tokenizer = pretrained.load("tiny-llama")
    model.eval()
    prefix = gritlm_instruction("Find the answer")
    examples = [Example(query(i), (positive(i),), (0,)) for i in range(3)]
    prefixes = Prefixes(prefix, gritlm_instruction(""))
    batch = collate_pairs(pair_seqs(tokenizer, examples, 48, prefixes), tokenizer.pad_token_id)
    skips = (prefix_length(tokenizer, prefixes.query), prefix_length(tokenizer, prefixes.doc))
    contrastive = Contrastive("mean", 0.02, bidirectional=True, skips=skips)
    with torch.no_grad():
        q = embed(model, batch.query_ids, batch.query_mask, "mean", True, contrastive.skips[0])
    expected = encode_texts(model, tokenizer, [query(i) for i in range(3)], pooling="mean", max_length=48,
                            bidirectional=True, prefix=prefix, include_prompt=False)
    torch.testing.assert_close(q, expected, rtol=1e-4, atol=1e-5)


def test_a_bidirectional_embedding_pass_never_runs_causally(monkeypatch):
    """auto attention is sdpa for GRIT's (and --bidirectional's) pass, as flash-attention would ignore the 4D
    mask; a model that ignores it anyway is an error, not a causal pass."""
    assert setup.attention(Config(objective="grit", grit_train_file="sft.jsonl"), "lm") == "sdpa"
    assert setup.attention(Config(objective="contrastive", bidirectional=True), "lm") == "sdpa"
    assert setup.attention(Config(objective="contrastive"), "lm") == "auto"  # causal by choice: last-token pooling
    assert setup.attention(Config(objective="grit", grit_train_file="sft.jsonl", attn_implementation="eager"), "lm") == "eager"
    model, _ = pretrained.load("tiny-llama")
    monkeypatch.setattr(setup, "bidirectional_supported", lambda model: False)
    with pytest.raises(UserError, match="ignores a bidirectional mask"):
        setup.resolve_bidirectional(Config(objective="grit", grit_train_file="sft.jsonl"), model, "lm")
    assert setup.resolve_bidirectional(Config(objective="grit", grit_train_file="sft.jsonl", bidirectional=False), model, "lm") is False


def test_grit_generative_batch_size_takes_that_many_instruction_examples(tmp_path):
    _, tokenizer = pretrained.load("tiny-llama")
    pairs = pair_seqs(tokenizer, [Example(query(i), (positive(i),), (0,)) for i in range(6)], 32)
    _, sft = write_data(tmp_path)
    task = CustomTask(Config(task_name="custom", train_file=str(sft)).data)
    seqs = formats.instruction_seqs(tokenizer, load_rows(task, "train", None), 48, False,
                                    formats.stop_token_ids(tokenizer))
    generative = sequence_training_set(seqs, tokenizer.pad_token_id, token_mean=True)
    batch = grit_training_set(pairs, generative, tokenizer.pad_token_id, generative_batch=2).batch([3, 4, 5, 0])
    assert batch.pairs.n_examples == 4 and batch.generative.n_examples == 2
    whole = grit_training_set(pairs, generative, tokenizer.pad_token_id).batch([3, 4, 5, 0])
    assert whole.generative.n_examples == 4
    torch.testing.assert_close(batch.generative.input_ids, generative.batch([3, 4]).input_ids)
    with pytest.raises(UserError, match="--grit_generative_batch_size 9"):
        Config(objective="grit", grit_train_file="sft.jsonl", grit_generative_batch_size=9, per_device_train_batch_size=8)
