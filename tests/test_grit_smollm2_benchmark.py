"""benchmarks/grit_smollm2.py's harness: the rate is GRIT's best dev recall@1 at seed 0 and contrastive only
takes it; every model is measured with GRIT's embedding; dev, train and test pairs do not overlap; finished runs are
reused."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import load_benchmark

from xgblora.config import Config


def gsm8k_folder(root: Path) -> Path:
    for split, n in (("train", 30), ("test", 12)):
        (root / "gsm8k").mkdir(parents=True, exist_ok=True)
        (root / "gsm8k" / f"{split}.jsonl").write_text("".join(
            json.dumps({"question": f"{split} question {i}?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}) + "\n"
            for i in range(n)), encoding="utf-8")
    return root


def test_rate_chosen_on_dev_by_grit_and_every_model_embeds_as_grit(tmp_path, monkeypatch):
    bench = load_benchmark("grit_smollm2")
    configs: list[Config] = []

    def fake_run(cfg: Config) -> dict:  # write what a finished run or evaluation writes
        configs.append(cfg)
        out = Path(cfg.output_dir)
        out.mkdir(parents=True)
        result = {"recall@1": {2e-4: 0.6, 1e-3: 0.7}.get(cfg.learning_rate, 0.5) if cfg.trainer != "none" else 0.5,
                  "mrr": 0.6, "loss": 1.5, "train_runtime_s": 10.0}
        (out / "results.json").write_text(json.dumps(result))
        if cfg.objective == "lm":
            (out / "predictions.jsonl").write_text(json.dumps({"prediction": "#### 2", "reference": "#### 2"}) + "\n")
        return result

    monkeypatch.setattr(bench.sft, "run", fake_run)
    argv = ["grit_smollm2.py", "--data_dir", str(gsm8k_folder(tmp_path / "data")), "--out", str(tmp_path / "out"),
            "--seeds", "0", "1", "--dev", "5", "--test", "4", "--heldout", "3", "--steps", "6"]
    monkeypatch.setattr("sys.argv", argv)
    bench.main()

    trained = [c for c in configs if c.trainer != "none"]
    assert [(c.objective, c.learning_rate, c.seed) for c in trained] == [
        ("grit", 2e-4, 0), ("grit", 1e-3, 0), ("contrastive", 1e-3, 0), ("grit", 1e-3, 1), ("contrastive", 1e-3, 1)]
    for c in trained:
        assert (c.method, c.lora_target_modules, c.lr_scheduler_type, c.max_steps) == ("lora", "all-linear",
                                                                                       "constant", 6)
        assert c.eval_file.endswith("pairs-dev.jsonl") and c.train_file.endswith("pairs-train.jsonl")
        assert (c.grit_train_file is not None) == (c.objective == "grit")
    contrastive = [c for c in trained if c.objective == "contrastive"]
    assert all(c.bidirectional and c.contrastive_temperature == 0.02 for c in contrastive)  # GRIT's embedding
    embedding = [c for c in configs if c.trainer == "none" and c.objective != "lm"]
    assert {c.objective for c in embedding} == {"grit"} and len(embedding) == 5  # base, and 2 rows x 2 seeds
    assert all(c.eval_file.endswith("pairs-test.jsonl") for c in embedding)
    assert embedding[0].adapter is None and all(c.adapter.endswith("final") for c in embedding[1:])

    out = tmp_path / "out"
    pairs = {s: [json.loads(line)["query"] for line in (out / f"pairs-{s}.jsonl").open()]
             for s in ("train", "dev", "test")}
    assert (len(pairs["train"]), len(pairs["dev"]), len(pairs["test"])) == (25, 5, 4)
    assert not set(pairs["train"]) & set(pairs["dev"]) and all(q.startswith("test") for q in pairs["test"])
    chat = [json.loads(line)["messages"][0]["content"] for line in (out / "chat-train.jsonl").open()]
    assert [c.split("\n")[0] for c in chat] == pairs["train"]  # GRIT's chat rows: the training questions
    table = (out / "table.md").read_text()
    assert "| GRIT (contrastive + generative) | 2 | 50.0 ± 0.0 | 60.0 ± 0.0 | 1.500 ± 0.000 | 100 ± 0 | 100 ± 0 |" \
        in table

    configs.clear()
    bench.main()  # every run finished: nothing runs again
    assert configs == []
    monkeypatch.setattr("sys.argv", [*argv[:6], "2", *argv[8:]])  # --seeds 2 alone: the rate is still seed 0's
    bench.main()
    assert [(c.objective, c.learning_rate, c.seed) for c in configs if c.trainer != "none"] == [
        ("grit", 1e-3, 2), ("contrastive", 1e-3, 2)]
