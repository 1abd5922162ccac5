"""Malformed input of every kind through the command line: one line on stderr naming what is wrong, exit code 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from xgblora import cli


def jsonl(*rows) -> str:
    """JSONL text of rows."""
    return "".join(json.dumps(row) + "\n" for row in rows)


RTE_OK = {"premise": "P.", "hypothesis": "H.", "label": "entailment"}
SST2 = {"sst2/train.jsonl": jsonl(*({"sentence": f"a fine film {i}", "label": i % 2} for i in range(8))),
        "sst2/dev.jsonl": jsonl({"sentence": "dull", "label": 0})}
SST2_RUN = ["--task_name", "SST2", "--data_dir", "{d}", "--num_train", "8", "--num_eval", "1", "--device", "cpu",
            "--max_length", "32"]
CUSTOM_CLS = ["--task_name", "custom", "--train_file", "{d}/t.jsonl", "--template", "{text} It was",
              "--label_words", "terrible,great"]
CUSTOM = ["--task_name", "custom", "--train_file", "{d}/t.jsonl"]
CHAT = [*CUSTOM, "--model_name", "tiny-llama-chat", "--num_train", "1", "--max_steps", "1"]
CHAT_ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}

# (name, files to write under {d}, the arguments of `xgblora train`, the message after "error: " as a regex over
# the whole rest of the line; {d} is the test's folder in both). Arguments are written as the user types them.
CASES = [
    # data files
    ("bad-json", {"rte/train.jsonl": jsonl(RTE_OK) + '{"premise": "P", "label": 0\n'}, ["--task_name", "RTE"],
     r"{d}/rte/train\.jsonl:2: not valid JSON \(Expecting ',' delimiter at column 28\)"),
    ("not-an-object", {"rte/train.jsonl": jsonl(RTE_OK, [1, 2])}, ["--task_name", "RTE"],
     r"{d}/rte/train\.jsonl:2: expected a JSON object, got an array"),
    ("null-line", {"rte/train.jsonl": "null\n"}, ["--task_name", "RTE"],
     r"{d}/rte/train\.jsonl:1: expected a JSON object, got null"),
    ("missing-field", {"rte/train.jsonl": jsonl(RTE_OK, RTE_OK, {"premise": "P.", "label": 0})},
     ["--task_name", "RTE"], r'{d}/rte/train\.jsonl:3: field "hypothesis": missing'),
    ("wrong-type", {"rte/train.jsonl": jsonl({**RTE_OK, "premise": 3})}, ["--task_name", "RTE"],
     r'{d}/rte/train\.jsonl:1: field "premise": expected a string, got int'),
    ("unknown-label", {"rte/train.jsonl": jsonl(RTE_OK, {**RTE_OK, "label": "maybe"})}, ["--task_name", "RTE"],
     r"""{d}/rte/train\.jsonl:2: field "label": 'maybe' is not one of entailment, not_entailment"""),
    ("bool-label-as-word", {"wic/train.jsonl": jsonl({"word": "w", "sentence1": "a", "sentence2": "b",
                                                      "label": "yes"})}, ["--task_name", "WIC"],
     r"""{d}/wic/train\.jsonl:1: field "label": 'yes' is not one of false, true"""),
    ("empty-file", {"rte/train.jsonl": ""}, ["--task_name", "RTE"], r"{d}/rte/train\.jsonl: empty file \(no JSON lines\)"),
    ("blank-file", {"rte/train.jsonl": "\n  \n"}, ["--task_name", "RTE"],
     r"{d}/rte/train\.jsonl: empty file \(no JSON lines\)"),
    ("empty-text", {"sst2/train.jsonl": jsonl({"sentence": " ", "label": 1})}, ["--task_name", "SST2"],
     r'{d}/sst2/train\.jsonl:1: field "sentence": empty string'),
    ("not-utf8", {"rte/train.jsonl": jsonl(RTE_OK).encode() + b'{"premise": "caf\xe9"}\n'}, ["--task_name", "RTE"],
     r"{d}/rte/train\.jsonl:2: not UTF-8 text \(byte 0xe9 at column 17\); save the file as UTF-8"),
    ("utf16-bom", {"rte/train.jsonl": jsonl(RTE_OK).encode("utf-16")}, ["--task_name", "RTE"],
     r"{d}/rte/train\.jsonl:1: UTF-16 text \(it starts with a UTF-16 byte-order mark\); save the file as UTF-8"),
    ("nested-type", {"multirc/train.jsonl": jsonl({"passage": {"text": "P", "questions": {}}})},
     ["--task_name", "MultiRC"], r'{d}/multirc/train\.jsonl:1: field "passage\.questions": expected a list, got dict'),
    ("data-dir-missing-the-task", {"sst2/train.jsonl": jsonl({"sentence": "a", "label": 0}), "cb/x": ""},
     ["--task_name", "RTE"], r"--data_dir {d}: no folder 'rte' for task RTE \(it holds: cb, sst2\)"),
    ("no-train-file", {"rte/dev.jsonl": jsonl(RTE_OK)}, ["--task_name", "RTE"], r"{d}/rte/train\.jsonl: no such file"),
    ("no-data-dir", {}, ["--task_name", "RTE", "--data_dir", "{d}/nope"], r"--data_dir {d}/nope: no such folder"),
    ("unknown-task", {}, ["--task_name", "glue-sst5"],
     r"unknown task 'glue-sst5': choose one of SST2, RTE, CB, BoolQ, Copa, WIC, WSC, MultiRC, ReCoRD, SQuAD, "
     r"DROP or custom"),
    ("custom-slot-missing", {"t.jsonl": jsonl({"text": "a", "label": 0}, {"txt": "b", "label": 1})}, CUSTOM_CLS,
     r'{d}/t\.jsonl:2: field "text": missing; the row has: txt, label \(--columns text=YOURS maps your column to it\)'),
    ("custom-unknown-label", {"t.jsonl": jsonl({"text": "a", "label": 2})}, CUSTOM_CLS,
     r'{d}/t\.jsonl:1: field "label": 2 is not one of 0, 1'),
    ("custom-response-type", {"t.jsonl": jsonl({"prompt": "p", "response": ["r"]})}, CUSTOM,
     r'{d}/t\.jsonl:1: field "response": expected a string, got list'),
    ("custom-no-such-file", {}, CUSTOM, r"{d}/t\.jsonl: no such file"),
    ("custom-without-train-file", {}, ["--task_name", "custom"], r"task 'custom' needs --train_file: with --template and --label_words for classification, else instruction rows.*"),
    # YAML configs
    ("yaml-unknown-key", {"c.yaml": "task_name: SST2\nlearning_rte: 1e-5\n"}, ["--config", "{d}/c.yaml"],
     r"{d}/c\.yaml: unknown key 'learning_rte'; did you mean 'learning_rate'\?"),
    ("yaml-wrong-type", {"c.yaml": "num_train: many\n"}, ["--config", "{d}/c.yaml"],
     r"{d}/c\.yaml: key 'num_train': expected int, got str 'many'"),
    ("yaml-bool-as-string", {"c.yaml": "zo_dual: 'yes'\n"}, ["--config", "{d}/c.yaml"],
     r"{d}/c\.yaml: key 'zo_dual': expected bool, got str 'yes'"),
    ("yaml-bad-choice", {"c.yaml": "trainer: adam\n"}, ["--config", "{d}/c.yaml"],
     r"{d}/c\.yaml: key 'trainer': 'adam' is not one of none, regular, zo"),
    ("yaml-null", {"c.yaml": "model_name: null\n"}, ["--config", "{d}/c.yaml"],
     r"{d}/c\.yaml: key 'model_name': expected str, got null"),
    ("yaml-not-a-mapping", {"c.yaml": "- a\n- b\n"}, ["--config", "{d}/c.yaml"],
     r"{d}/c\.yaml: expected a mapping of option: value, got list"),
    ("yaml-syntax", {"c.yaml": "a: [1\n"}, ["--config", "{d}/c.yaml"], r"{d}/c\.yaml:2: not valid YAML \(.*\)"),
    ("yaml-key-twice", {"c.yaml": "learning_rate: 1.0e-4\nnum_train: 4\nlearning-rate: 1.0e-3\nlearning_rate: 1.0e-2\n"},
     ["--config", "{d}/c.yaml"],
     r"{d}/c\.yaml:4: not valid YAML \(key 'learning_rate' is given twice, first on line 1; keep one\)"),
    ("yaml-option-twice", {"c.yaml": "learning_rate: 1.0e-4\nlearning-rate: 1.0e-3\n"}, ["--config", "{d}/c.yaml"],
     r"{d}/c\.yaml: keys 'learning_rate' and 'learning-rate' both set learning_rate; keep one"),
    ("yaml-missing", {}, ["--config", "{d}/none.yaml"], r"{d}/none\.yaml: cannot read config file \(FileNotFoundError.*\)"),
    # flags
    ("unknown-flag", {}, ["--learning_rte", "1e-5"],
     r"unrecognized arguments: --learning_rte 1e-5; did you mean --learning_rate\? \(see xgblora train --help\)"),
    ("flag-wrong-type", {}, ["--num_train", "many"],
     r"argument --num_train/--num-train: invalid int value: 'many' \(see xgblora train --help\)"),
    ("bad-nan-policy", {}, ["--nan_policy", "ignore"],
     r"argument --nan_policy/--nan-policy: invalid choice: 'ignore' \(choose from .*stop.*skip.*\) "
     r"\(see xgblora train --help\)"),
    ("negative-lr", {}, ["--learning_rate", "-0.001"], r"--learning_rate must be positive, got -0\.001"),
    ("max-length-1", {}, ["--max_length", "1"],
     r"--max_length must be at least 2 \(a token is scored from the tokens before it\), got 1"),
    ("nan-lr", {}, ["--learning_rate", "nan"], r"--learning_rate must be a finite number, got nan"),
    ("inf-lr", {}, ["--learning_rate", "inf"], r"--learning_rate must be a finite number, got inf"),
    ("method-and-xgblora", {}, ["--method", "lora", "--xgblora"],
     r"--method lora and --xgblora name different methods; pass one of them"),
    ("lora-and-xgblora", {}, ["--lora", "--xgblora"], r"--lora and --xgblora name different methods; pass one of them"),
    ("zero-batch", {}, ["--per_device_train_batch_size", "0"], r"--per_device_train_batch_size must be positive, got 0"),
    ("zero-save-steps", {}, ["--save_steps", "0"], r"--save_steps must be positive with --save_strategy steps, got 0"),
    ("dropout-over-1", {}, ["--lora_dropout", "1.5"], r"--lora_dropout must be in \[0, 1\), got 1\.5"),
    ("shrinkage-over-1", {}, ["--xgblora_shrinkage", "1.5"], r"--xgblora_shrinkage must be in \(0, 1\], got 1\.5"),
    ("zero-zo-eps", {}, ["--zo_eps", "0"], r"--zo_eps must be positive, got 0\.0"),
    ("float16-and-bfloat16", {}, ["--load_float16", "--load_bfloat16"],
     r"--load_float16 and --load_bfloat16 cannot both be set"),
    ("accumulation-with-mezo", {}, ["--trainer", "zo", "--gradient_accumulation_steps", "4"],
     r"--gradient_accumulation_steps does not apply to --trainer zo \(MeZO has no gradients to accumulate\); "
     r"raise --per_device_train_batch_size instead"),
    ("unknown-device", {}, ["--device", "gpu"], r"--device 'gpu': choose cpu, cuda, cuda:N \(the N-th GPU\), mps or auto"),
    ("negative-seed", {}, ["--seed", "-1"], r"--seed must be between 0 and 2\*\*32 - 1, got -1"),
    ("seed-over-32-bits", {}, ["--seed", str(2**32)], r"--seed must be between 0 and 2\*\*32 - 1, got 4294967296"),
    ("negative-num-train", SST2, [*SST2_RUN, "--num_train", "-1"], r"--num_train must be 0 or more, got -1"),
    ("negative-num-eval", SST2, [*SST2_RUN, "--num_eval", "-5"], r"--num_eval must be 0 or more, got -5"),
    ("negative-train-set-seed", SST2, [*SST2_RUN, "--train_set_seed", "-1"],
     r"--train_set_seed must be between 0 and 2\*\*32 - 1, got -1"),
    ("unknown-model", SST2, [*SST2_RUN, "--model_name", "no-such-org/no-such-model"],
     r"cannot load model 'no-such-org/no-such-model': not a built-in .*"),
    ("lora-r-over-width", SST2, [*SST2_RUN, "--method", "lora", "--lora_r", "100000", "--max_steps", "1"],
     r"--lora_r 100000 is larger than the adapted layer model\.decoder\.layers\.0\.self_attn\.v_proj \(64 inputs, "
     r"64 outputs\): B A has rank at most 64 there; pass --lora_r 64 or less"),
    ("fp16-on-cpu", SST2, [*SST2_RUN, "--trainer", "regular", "--fp16", "--max_steps", "1"],
     r"--fp16 autocast needs a CUDA device; on CPU use --bf16 \(this CPU may support it\)"),
    ("no-training-examples", SST2, [*SST2_RUN, "--trainer", "regular", "--num_train", "0"],
     r"--trainer regular needs training examples: --num_train is 0"),
    ("resume-without-checkpoint", SST2, [*SST2_RUN, "--trainer", "regular", "--max_steps", "1",
                                         "--resume_from_checkpoint", "latest"],
     r"--resume_from_checkpoint latest: no checkpoint under \S+/out/checkpoints"),
    # instruction and chat data, other file formats, column maps, chat templates, trackers
    ("chat-no-assistant", {"t.jsonl": jsonl({"messages": [{"role": "user", "content": "hi"}]})}, CHAT,
     r'{d}/t\.jsonl:1: field "messages": no message with role "assistant" to train on'),
    ("chat-role-unknown", {"t.jsonl": jsonl({"messages": [{"role": "wizard", "content": "hi"}, CHAT_ROW["messages"][1]]})},
     CHAT, r'{d}/t\.jsonl:1: field "messages\[0\]\.role": \'wizard\' is not a chat role; use one of system, user, '
     r"assistant, tool"),
    ("chat-role-missing", {"t.jsonl": jsonl({"messages": [{"content": "hi"}]})}, CHAT,
     r'{d}/t\.jsonl:1: field "messages\[0\]\.role": missing'),
    ("instruction-no-known-field", {"t.jsonl": jsonl({"question": "q", "answer": "a"})}, CUSTOM,
     r'{d}/t\.jsonl:1: field "messages": missing: instruction rows hold "messages", "prompt" and "completion" '
     r'\(or "response"\), or "text" \(--columns maps other names\); the row has: question, answer'),
    ("csv-column-missing", {"t.csv": "question,answer\nq,a\n"},
     ["--task_name", "custom", "--train_file", "{d}/t.csv", "--columns", "prompt=question,completion=solution"],
     r'{d}/t\.csv, row 1: field "solution": missing \(--columns maps it to \'completion\'\); the row has: '
     r"question, answer"),
    ("columns-bad", {"t.jsonl": jsonl({"prompt": "p", "completion": "c"})}, [*CUSTOM, "--columns", "prompt:question"],
     r"--columns 'prompt:question': 'prompt:question' is not OURS=THEIRS \(e\.g\. prompt=question\)"),
    ("no-such-parquet", {}, ["--task_name", "custom", "--train_file", "{d}/t.parquet"], r"{d}/t\.parquet: no such file"),
    ("chat-no-template", {"t.jsonl": jsonl(CHAT_ROW, CHAT_ROW)}, [*CUSTOM, "--model_name", "tiny-llama", "--num_train", "1"],
     r"this tokenizer has no chat template, so conversation rows cannot be rendered; pass --chat_template FILE "
     r"\(a Jinja template\), or use prompt/completion rows"),
    ("chat-template-fails", {"t.jsonl": jsonl(CHAT_ROW, CHAT_ROW), "bad.jinja": "{{ raise_exception('no system role') }}"},
     [*CHAT, "--chat_template", "{d}/bad.jinja"],
     r"{d}/t\.jsonl:\d: the chat template failed to render \(TemplateError: no system role\)"),
    ("chat-template-file-missing", {"t.jsonl": jsonl(CHAT_ROW, CHAT_ROW)}, [*CHAT, "--chat_template", "{d}/none.jinja"],
     r"--chat_template {d}/none\.jinja: cannot read \(FileNotFoundError: .*\)"),
    ("report-to-unknown", {}, [*SST2_RUN, "--report_to", "neptune"],
     r"--report_to 'neptune': unknown tracker 'neptune'; choose from none, tensorboard, wandb, mlflow, trackio "
     r"\(several: comma-separated\)"),
]


def write(path: Path, content: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))


@pytest.mark.parametrize(("files", "args", "message"), [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_malformed_input_is_one_line_and_exit_code_2(tmp_path, monkeypatch, capsys, files, args, message):
    monkeypatch.chdir(tmp_path)  # MeZO-style result copies go to ./result
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "in"
    folder.mkdir()
    for name, content in files.items():
        write(folder / name, content)
    argv = ["train", "--data_dir", str(folder), *(a.replace("{d}", str(folder)) for a in args),
            "--output_dir", str(tmp_path / "out")]
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    *logged, last = err.splitlines() or [""]
    assert code == 2, err
    assert re.fullmatch(r"xgblora train: error: " + message.replace("{d}", re.escape(str(folder))), last), err
    assert all(re.match(r"\d\d:\d\d:\d\d (INFO|WARNING) ", line) for line in logged), err  # no traceback
    assert not (tmp_path / "out").exists()  # a refused run leaves nothing behind (no bare config.yaml)



@pytest.mark.parametrize(("device", "message"), [
    ("mps", r"--device mps: no MPS device \(an Apple silicon GPU, with a torch built for it\) is available on this "
            r"machine; use cpu"),
    ("cuda", r"--device cuda: no CUDA device is available on this machine"),
    ("cuda:1", r"--device cuda:1: no CUDA device is available on this machine"),
])
def test_a_device_the_machine_lacks_is_one_line_before_the_model_loads(tmp_path, monkeypatch, capsys, device,
                                                                        message):
    import torch

    from xgblora.models import pretrained

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the device was checked")
    monkeypatch.setattr(pretrained, "load", refuse)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    folder = tmp_path / "in"
    for name, content in SST2.items():
        write(folder / name, content)
    argv = ["train", *(a.replace("{d}", str(folder)) for a in SST2_RUN), "--device", device, "--output_dir",
            str(tmp_path / "out")]
    assert cli.main(argv) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert re.fullmatch(r"xgblora train: error: " + message, last), last
    assert not (tmp_path / "out").exists()


def test_a_cuda_index_past_the_last_gpu_is_one_line(monkeypatch):
    import torch

    from xgblora.errors import UserError
    from xgblora.models import pretrained

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(UserError, match=r"^--device cuda:2: this machine has 2 CUDA device\(s\), cuda:0 to cuda:1$"):
        pretrained.choose_device("cuda:2")
    assert pretrained.choose_device("cuda:1") == torch.device("cuda:1")


# (name, the command, its arguments, the message): options that are out of range or contradict each other, refused
# as the options are read (no file is opened, no model loads). grpo and dpo get a --train_file name to get that far.
OPTION_CASES = [
    ("grpo-negative-beta", "grpo", ["--beta", "-1"], r"--beta must be 0 \(no KL term\) or more, got -1\.0"),
    ("grpo-epsilon-high-below-epsilon", "grpo", ["--epsilon_high", "0.1", "--epsilon", "0.2"],
     r"--epsilon_high 0\.1 is below --epsilon 0\.2: the ratio is kept within \[1 - epsilon, 1 \+ epsilon_high\], "
     r"and epsilon_high widens the upper side \(DAPO: 0\.28 with 0\.2\); pass at least --epsilon, or leave it unset "
     r"\(= --epsilon\)"),
    ("grpo-cispo-cap-below-1", "grpo", ["--loss_type", "cispo", "--epsilon_high", "0.1", "--epsilon", "0.2"],
     r"--policy_loss cispo caps each token's importance ratio at --epsilon_high: 0\.1 is below 1, the ratio of every "
     r"token of the sampling policy, so it would clip them all; pass --epsilon_high 5 \(ScaleRL's epsilon_max, "
     r"TRL's advice\)"),
    ("grpo-cispo-cap-unset", "grpo", ["--loss_type", "cispo"],
     r"--policy_loss cispo caps each token's importance ratio at --epsilon_high \(unset, it is --epsilon\): 0\.2 is "
     r"below 1, .*"),
    ("dpo-negative-rpo-alpha", "dpo", ["--rpo_alpha", "-1"],
     r"--rpo_alpha must be positive \(the weight of the chosen completions' NLL; leave it unset for none\), got -1\.0"),
    ("dpo-negative-simpo-gamma", "dpo", ["--loss_type", "simpo", "--simpo_gamma", "-5"],
     r"--simpo_gamma must be 0 or more \(SimPO's target margin by which the chosen reward beats the rejected one\), "
     r"got -5\.0"),
    ("dpo-loss-type-twice", "dpo", ["--loss_type", "sigmoid", "sigmoid"],
     r"--loss_type sigmoid sigmoid: sigmoid is given twice; give each loss type once and weight it with --loss_weights"),
    ("dpo-negative-loss-weight", "dpo", ["--loss_type", "sigmoid", "sft", "--loss_weights", "1", "-1"],
     r"--loss_weights must be 0 or more, got 1\.0 -1\.0"),
    ("dpo-prompt-longer-than-all", "dpo", ["--max_prompt_length", "500", "--max_length", "64"],
     r"--max_prompt_length 500 leaves no room under --max_length 64 \(prompt and completion\): a prompt that long "
     r"would keep no completion token and its pair would be dropped; pass a --max_prompt_length below --max_length"),
    ("dpo-precompute-reference-free", "dpo", ["--reference_free", "--precompute_ref_log_probs"],
     r"--precompute_ref_log_probs computes log-probabilities that nothing reads: --reference_free takes the "
     r"reference's log-probabilities as 0; drop it"),
    ("dpo-precompute-simpo", "dpo", ["--loss_type", "simpo", "--precompute_ref_log_probs"],
     r"--precompute_ref_log_probs computes log-probabilities that nothing reads: --loss_type simpo reads no "
     r"reference \(simpo, orpo, sft do not\); drop it"),
    ("negative-lora-alpha", "train", ["--method", "lora", "--lora_alpha", "-8"], r"--lora_alpha must be positive, got -8\.0"),
    ("empty-target-modules", "grpo", ["--lora_target_modules", ""],
     r"--lora_target_modules '' names no module: give name suffixes \(q_proj,v_proj\), all-linear or a regex, or "
     r"leave it unset for the default"),
    ("boosters-and-their-length", "train", ["--method", "xgblora", "--xgblora_num_boosters", "5",
                                            "--xgblora_steps_per_iteration", "3"],
     r"--xgblora_num_boosters 5 and --xgblora_steps_per_iteration 3 both set how long a booster trains "
     r"\(max_steps / boosters, or that many steps\); pass one of them"),
    ("dpo-precompute-orpo-rpo", "dpo", ["--loss_type", "orpo", "--rpo_alpha", "1", "--precompute_ref_log_probs"],
     r"--precompute_ref_log_probs computes log-probabilities that nothing reads: --loss_type orpo sft reads no "
     r"reference \(simpo, orpo, sft do not\); drop it"),
]


@pytest.mark.parametrize(("command", "args", "message"), [case[1:] for case in OPTION_CASES],
                         ids=[case[0] for case in OPTION_CASES])
def test_options_out_of_range_or_at_odds_are_refused_as_they_are_read(command, args, message):
    from xgblora import parsing
    from xgblora.errors import UserError

    files = ["--train_file", "rows.jsonl"] if command in ("grpo", "dpo") else []
    namespace = cli.build_parser().parse_args([command, *files, *args])
    spec = cli.COMMANDS[command]
    with pytest.raises(UserError) as error:
        parsing.from_namespace(spec.options, namespace, spec.defaults)
    assert re.fullmatch(message, str(error.value)), str(error.value)


@pytest.mark.parametrize(("command", "args"), [
    ("grpo", ["--loss_type", "cispo", "--epsilon_high", "5"]),
    ("grpo", ["--epsilon_high", "0.28"]),
    ("grpo", ["--epsilon_high", "0.2", "--beta", "0.04"]),
    ("dpo", ["--loss_type", "sigmoid", "sft", "--loss_weights", "1", "0"]),
    ("dpo", ["--loss_type", "simpo", "--simpo_gamma", "0"]),
    ("dpo", ["--max_prompt_length", "500", "--max_length", "1024"]),
    ("dpo", ["--loss_type", "sigmoid", "simpo", "--precompute_ref_log_probs"]),
    ("dpo", ["--rpo_alpha", "0.5", "--precompute_ref_log_probs"]),
])
def test_the_legitimate_neighbours_of_refused_options_are_taken(command, args):
    from xgblora import parsing

    files = ["--train_file", "rows.jsonl"] if command in ("grpo", "dpo") else []
    namespace = cli.build_parser().parse_args([command, *files, *args])
    spec = cli.COMMANDS[command]
    parsing.from_namespace(spec.options, namespace, spec.defaults)


@pytest.mark.parametrize("name", ["grpo-cispo-cap-unset", "dpo-precompute-simpo", "boosters-and-their-length"])
def test_options_at_odds_through_the_command_line_are_one_line_and_leave_nothing(tmp_path, monkeypatch, capsys, name):
    from xgblora.models import pretrained

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")
    monkeypatch.setattr(pretrained, "load", refuse)
    monkeypatch.chdir(tmp_path)
    command, args, message = next(case[1:] for case in OPTION_CASES if case[0] == name)
    files = ["--train_file", "rows.jsonl"] if command in ("grpo", "dpo") else []
    assert cli.main([command, *files, *args, "--output_dir", "out"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and re.fullmatch(rf"xgblora {command}: error: {message}", lines[0]), lines
    assert not list(tmp_path.iterdir())
