"""Preference data: TRL's formats, tokens as TRL's DPOTrainer makes them, truncation, located errors; the shared-prompt
forward equals full rows (values and gradients), also in MeZO's dual batch and in micro-batches."""

import json

import pytest
import torch

from xgblora.adapters.lora import adapters_off, attach
from xgblora.data.preference import (
    PreferenceSeq,
    check_row,
    collate_preferences,
    encode,
    read_preferences,
    truncate,
)
from xgblora.errors import UserError
from xgblora.models import pretrained
from xgblora.models.scoring import token_logprobs
from xgblora.preference.objective import Objective
from xgblora.preference.scoring import PreferenceLoss, completion_logps

MODEL, TOKENIZER = pretrained.load("tiny-llama")


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_standard_conversational_and_implicit_rows(tmp_path):
    rows = [{"prompt": "Q: 2+2?", "chosen": " 4", "rejected": " 5"},
            {"chosen": "The sky is blue.", "rejected": "The sky is green."},
            {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "hello"}],
             "rejected": [{"role": "assistant", "content": "go away"}]},
            {"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
             "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "b"}]}]
    got = read_preferences(write_rows(tmp_path / "p.jsonl", rows))
    assert (got[0].prompt, got[0].chosen, got[0].rejected) == ("Q: 2+2?", " 4", " 5")
    assert (got[1].prompt, got[1].chosen, got[1].rejected) == ("The sky is", " blue.", " green.")  # TRL's split
    assert got[3].prompt == [{"role": "user", "content": "hi"}] and got[3].chosen[0]["content"] == "a"
    assert got[2].conversational and not got[0].conversational


def test_column_map(tmp_path):
    path = write_rows(tmp_path / "p.jsonl", [{"question": "q", "good": " a", "bad": " b"}])
    ex, = read_preferences(path, "prompt=question,chosen=good,rejected=bad")
    assert (ex.prompt, ex.chosen, ex.rejected) == ("q", " a", " b")


USER, ANSWER, OTHER = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                       {"role": "assistant", "content": "go away"})


@pytest.mark.parametrize(("row", "field", "what"), [
    ({"prompt": "q", "chosen": " a"}, "rejected", "missing"),
    ({"prompt": "q", "chosen": " a", "rejected": " a"}, "rejected", "same as chosen"),
    ({"prompt": "q", "chosen": "", "rejected": " b"}, "chosen", "empty completion"),
    ({"prompt": "q", "chosen": [{"role": "assistant", "content": ""}], "rejected": [{"role": "assistant",
                                                                                      "content": "x"}]},
     "prompt", "mixes formats"),
    ({"prompt": "q", "chosen": 3, "rejected": " b"}, "chosen", "expected a string"),
    ({"prompt": " \n ", "chosen": " a", "rejected": " b"}, "prompt", "empty string: a row needs a prompt"),
    ({"prompt": [USER, {"role": "wizard", "content": "x"}], "chosen": [ANSWER], "rejected": [OTHER]}, "prompt[1].role",
     "'wizard' is not a chat role; use one of system, user, assistant, tool"),
    ({"prompt": [USER], "chosen": [{"role": "user", "content": "a"}], "rejected": [OTHER]}, "chosen[0].role",
     "'user' in a completion: a completion is the assistant's reply, starting with an assistant turn"),
    ({"prompt": [USER], "chosen": [ANSWER], "rejected": [OTHER, {"role": "system", "content": "b"}]},
     "rejected[1].role", "'system' in a completion"),
    ({"prompt": [USER], "chosen": [{"role": "tool", "content": "1"}, ANSWER], "rejected": [OTHER]}, "chosen[0].role",
     "'tool' in a completion"),
    ({"prompt": [USER, ANSWER], "chosen": [ANSWER], "rejected": [OTHER]}, "prompt",
     "ends with an assistant turn: the completions are the assistant's reply to the prompt's last turn"),
    ({"chosen": [USER, {"role": "user", "content": "and?"}], "rejected": [USER, OTHER]},
     "chosen[1].role", "'user' in a completion"),  # implicit prompt: indices count from the row's first turn
    ({"chosen": [USER, ANSWER, ANSWER], "rejected": [USER, ANSWER, OTHER]}, "chosen",
     "and rejected begin with a prompt that ends with an assistant turn"),
])
def test_bad_rows_name_file_row_and_field(tmp_path, row, field, what):
    path = write_rows(tmp_path / "p.jsonl", [{"prompt": "ok", "chosen": " x", "rejected": " y"}, row])
    with pytest.raises(UserError) as err:
        read_preferences(path)
    assert str(err.value).startswith(f'{path}:2: field "{field}": ') and what in str(err.value)


def test_bad_row_exits_2_before_the_model_loads(tmp_path, capsys):
    from xgblora import cli
    path = write_rows(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": " a", "rejected": " a"}])
    code = cli.main(["dpo", "--model_name", "no-such-model-anywhere", "--train_file", path,
                     "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f'{path}:1: field "rejected"' in err[0]
    assert not (tmp_path / "out").exists()


def test_a_conversation_with_tool_results_in_its_completion_is_a_pair(tmp_path):
    """An assistant reply that calls a tool: assistant, tool result, assistant; the prompt may end with a tool turn."""
    tool = {"role": "tool", "content": "42"}
    path = write_rows(tmp_path / "p.jsonl", [{"prompt": [USER], "chosen": [ANSWER, tool, ANSWER],
                                              "rejected": [OTHER]},
                                             {"prompt": [USER, ANSWER, tool], "chosen": [ANSWER], "rejected": [OTHER]}])
    assert [len(ex.chosen) for ex in read_preferences(path)] == [3, 1]


def test_tokens_as_trl_makes_them():
    """Standard rows: EOS appended, the completion starts where prompt and prompt+completion tokens diverge."""
    ex = check_row(("f", 1), {"prompt": "Hello there", "chosen": " friend", "rejected": " enemy of mine"})
    seq = encode(TOKENIZER, ex)
    full = TOKENIZER("Hello there friend" + TOKENIZER.eos_token)["input_ids"]
    assert seq.prompt + seq.chosen == full and seq.chosen[-1] == TOKENIZER.eos_token_id
    assert seq.prompt == TOKENIZER("Hello there")["input_ids"]


def test_truncation():
    seq = PreferenceSeq([1, 2, 3, 4], [5, 6, 7], [8])
    assert truncate(seq, 6, None) == PreferenceSeq([1, 2, 3, 4], [5, 6], [8])
    assert truncate(seq, 6, 2) == PreferenceSeq([3, 4], [5, 6, 7], [8])
    assert truncate(seq, 4, None) is None


SEQS = [PreferenceSeq([1, 5, 9], [11, 12, 2], [13, 2]), PreferenceSeq([1, 7], [21, 2], [22, 23, 24, 2]),
        PreferenceSeq([1, 4, 4, 4, 6], [30, 2], [31, 2])]


def full_row_logps(model, seqs):
    """Each completion's summed log-probability from its own full prompt+completion row (no padding)."""
    out = []
    for which in ("chosen", "rejected"):
        for s in seqs:
            ids = torch.tensor([s.prompt + getattr(s, which)])
            logits = model(input_ids=ids).logits[:, len(s.prompt) - 1:-1]
            out.append(token_logprobs(logits, ids[:, len(s.prompt):]).sum())
    return torch.stack(out)


def _lora_model():
    torch.manual_seed(0)
    model = pretrained.load("tiny-llama")[0]
    report = attach(model, None, r=4, alpha=8)
    for m in report.modules.values():
        torch.nn.init.normal_(m.lora_B, std=0.02)
    return model, report.modules


def test_shared_prompt_forward_equals_full_rows_with_gradients():
    model, modules = _lora_model()
    batch = collate_preferences(SEQS, TOKENIZER.pad_token_id)
    got, _ = completion_logps(model, batch)
    params = [m.lora_B for m in modules.values()]
    grads = torch.autograd.grad(got.sum(), params)
    want = full_row_logps(model, SEQS)
    want_grads = torch.autograd.grad(want.sum(), params)
    assert torch.allclose(got, want, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, want_grads, strict=True))


def test_dual_batch_halves_and_micro_batches():
    """The doubled batch's two halves each give the batch's losses (no perturbation set), a split gives its pairs'."""
    model, modules = _lora_model()
    loss = PreferenceLoss(Objective(beta=0.3), reference=lambda: adapters_off(modules))
    batch = collate_preferences(SEQS, TOKENIZER.pad_token_id)
    with torch.no_grad():
        once, twice, piece = loss(model, batch), loss(model, batch.doubled()), loss(model, batch.split(1, 3))
    assert twice.shape == (6,) and torch.allclose(twice[:3], once, atol=1e-6) and torch.allclose(twice[3:], once, atol=1e-6)
    assert torch.allclose(piece, once[1:], atol=1e-6)
    ref = collate_preferences(SEQS, TOKENIZER.pad_token_id, torch.zeros(3, 2))
    with torch.no_grad():  # a precomputed reference replaces the adapters-off forward
        assert not torch.allclose(loss(model, ref), once)
