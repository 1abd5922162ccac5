"""benchmarks/smollm2_mezo.py's harness: every command it runs is one xgblora accepts, under MeZO's protocol for
the task; the rate is chosen on dev at seed 0, whichever seeds a process runs (a tie to the smaller); finished runs
are reused; the table lands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_benchmark

from xgblora import cli, config, parsing


@pytest.mark.parametrize("task, num_train, num_dev, classification", [("SST2", 1000, 500, True),
                                                                      ("Copa", 300, 100, False)])
def test_commands_parse_and_the_rate_is_chosen_on_dev(tmp_path, monkeypatch, task, num_train, num_dev,
                                                      classification):
    bench = load_benchmark("smollm2_mezo")
    configs: list[config.Config] = []

    def fake_run(cmd, check):  # parse as `xgblora` would, then write what a finished run writes
        command, flags = cmd[3], cmd[4:]
        ns = cli.build_parser().parse_args([command, *flags])
        cfg = parsing.from_namespace(cli.COMMANDS[command].options, ns, cli.COMMANDS[command].defaults)
        cfg = cfg.run_config() if command == "eval" else cfg  # the train options xgblora eval runs
        configs.append(cfg)
        dev = {1e-4: 0.7, 1e-3: 0.8, 3e-4: 0.75}.get(cfg.learning_rate, 0.6)  # 1e-5 and 3e-5 tie at 0.6
        result = {"accuracy": 0.5 + cfg.seed / 100, "dev_accuracy": dev, "train_runtime_s": 10.0,
                  "peak_memory_mb": 100.0}
        Path(cfg.output_dir).mkdir(parents=True)
        (Path(cfg.output_dir) / "results.json").write_text(json.dumps(result))

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    argv = ["smollm2_mezo.py", "--data_dir", "data", "--task", task, "--out", str(tmp_path), "--seeds", "0", "1",
            "--zo_steps", "40", "--fo_steps", "8", "--rows", "zero-shot", "MeZO-LoRA r=8", "FT (AdamW)"]
    monkeypatch.setattr(bench.sys, "argv", argv)
    bench.main()
    zero_shot, *trained = configs
    assert zero_shot.trainer == "none" and zero_shot.num_train == 0
    assert {c.task_name for c in configs} == {task}
    mezo = [c for c in trained if c.trainer == "zo"]
    assert [(c.learning_rate, c.seed) for c in mezo] == [(1e-4, 0), (1e-3, 0), (1e-3, 1)]  # best dev, then seed 1
    ft = [c for c in trained if c.method == "ft"]
    assert [(c.learning_rate, c.seed) for c in ft] == [(1e-5, 0), (3e-5, 0), (1e-5, 1)]  # the tie to the smaller
    for c in trained:  # MeZO's data protocol and settings
        assert (c.num_train, c.num_dev, c.train_set_seed, c.per_device_train_batch_size) == (num_train, num_dev,
                                                                                             c.seed, 16)
        assert c.train_as_classification == classification  # as MeZO's mezo.sh sets the loss per task
        assert c.load_best_model_at_end and c.evaluation_strategy == "steps"
        assert c.max_steps == (40 if c.trainer == "zo" else 8) and c.eval_steps == c.max_steps // 4
        assert c.lr_scheduler_type == "constant"  # MeZO's for the ZO rows; xgblora's default for AdamW
    table = (tmp_path / "table.md").read_text()
    assert "| MeZO-LoRA r=8 | 50.5 ± 0.7 | 80.0 ± 0.0 | 2 | 0.001 | 40 |" in table
    assert "| FT (AdamW) | 50.5 ± 0.7 | 60.0 ± 0.0 | 2 | 1e-05 | 8 |" in table

    configs.clear()
    bench.main()  # every run finished: nothing runs again
    assert configs == []

    monkeypatch.setattr(bench.sys, "argv", [*argv[:argv.index("--seeds") + 1], "2", *argv[argv.index("--zo_steps"):]])
    bench.main()  # another process's seed: the rates chosen at seed 0 (reused), no grid at seed 2
    assert [(c.trainer, c.learning_rate, c.seed) for c in configs if c.trainer != "none"] == [("zo", 1e-3, 2),
                                                                                            ("regular", 1e-5, 2)]
