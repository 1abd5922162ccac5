"""--load_in_4bit: an NF4 base (bitsandbytes, double quantisation) under fp32 adapters, on the CPU: gradients equal
autograd's through the dequantised weight, AdamW and MeZO train the adapters and never touch the 4-bit weights,
and an XGBLoRA merge into a 4-bit layer keeps the outputs of an fp32 merge."""

import tempfile

import pytest
import torch
import torch.nn.functional as F

from xgblora.adapters.lora import LoRALinear, attach, lora_modules
from xgblora.config import Config
from xgblora.demo import LABEL_WORDS, TEMPLATE, write_data
from xgblora.errors import UserError
from xgblora.models import pretrained, quant
from xgblora.recipes.sft import run
from xgblora.train import loop

pytest.importorskip("bitsandbytes")
IDS = torch.randint(3, 400, (2, 10), generator=torch.Generator().manual_seed(0))


def dequantized_weight(module: torch.nn.Module) -> torch.Tensor:
    """The (out, in) weight a 4-bit layer computes with, dequantised to fp32 by bitsandbytes itself."""
    import bitsandbytes as bnb

    return bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state).float()


def _quantized_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.weight.data.clone() for n, m in model.named_modules() if quant.is_quantized(m)}


def test_both_loaders_quantise_the_seven_projections_of_each_block_alike() -> None:
    model, tokenizer = pretrained.load("tiny-llama", load_in_4bit=True)
    assert sorted(n.rsplit(".", 1)[-1] for n in _quantized_weights(model) if ".0." in n) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert not quant.is_quantized(model.lm_head)
    with tempfile.TemporaryDirectory() as folder:  # transformers' loader with BitsAndBytesConfig
        fp32, _ = pretrained.load("tiny-llama")
        fp32.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        loaded, _ = pretrained.load(folder, load_in_4bit=True)
    with torch.no_grad():
        ours, theirs, full = model(input_ids=IDS).logits, loaded(input_ids=IDS).logits, fp32(input_ids=IDS).logits
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
    assert 0 < (ours - full).abs().max() < 0.25 * full.abs().max()  # NF4 rounding, not a different model


def test_adapter_gradients_through_a_4bit_base_equal_autograd_on_the_dequantised_weight() -> None:
    model, _ = pretrained.load("tiny-llama", load_in_4bit=True)
    layer = model.model.layers[0].self_attn.q_proj
    lora = LoRALinear(layer, r=4, alpha=8)
    torch.nn.init.normal_(lora.lora_B)
    x = torch.randn(3, 5, 64)
    lora(x).square().sum().backward()
    A, B = lora.lora_A.detach().clone().requires_grad_(), lora.lora_B.detach().clone().requires_grad_()
    reference = F.linear(x, dequantized_weight(layer)) + 2.0 * F.linear(F.linear(x, A), B)
    reference.square().sum().backward()
    torch.testing.assert_close(lora.lora_A.grad, A.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lora.lora_B.grad, B.grad, rtol=1e-4, atol=1e-4)


def test_an_xgblora_merge_into_a_4bit_layer_keeps_the_fp32_merge_within_1e_5() -> None:
    """The side factors reproduce dequantised weight + fp32 delta to 1e-5 of the output's scale; re-quantising the
    merged weight (ReLoRA style) is measured beside it and is NF4-rounding far off."""
    bnb = quant.require_bitsandbytes()
    model, _ = pretrained.load("tiny-llama", load_in_4bit=True)
    layer = model.model.layers[0].mlp.down_proj
    lora = LoRALinear(layer, r=1, alpha=2)
    torch.nn.init.normal_(lora.lora_B, std=0.05)
    x = torch.randn(4, 176)
    for _ in range(3):  # three boosters merged, each re-initialised
        lora.merge()
        lora.reset()
        torch.nn.init.normal_(lora.lora_B, std=0.05)
    lora.active = False
    merged_fp32 = dequantized_weight(layer) + lora.merged_B @ lora.merged_A
    with torch.no_grad():
        ours, exact = lora(x), F.linear(x, merged_fp32)
        requantized = bnb.nn.Params4bit(merged_fp32, requires_grad=False, quant_type="nf4",
                                        compress_statistics=True).to("cpu")
        relora = F.linear(x, bnb.functional.dequantize_4bit(requantized.data, requantized.quant_state))
    scale = exact.abs().max()
    assert (ours - exact).abs().max() <= 1e-5 * scale
    assert (relora - exact).abs().max() > 100 * (ours - exact).abs().max()


@pytest.mark.parametrize("method, trainer", [("lora", "regular"), ("lora", "zo"), ("xgblora", "zo")])
def test_a_4bit_base_trains_its_adapters_and_keeps_its_weights(tmp_path, monkeypatch, method: str, trainer: str) -> None:
    train_file, eval_file = write_data(tmp_path / "data", n_train=40, n_eval=8)
    before = _quantized_weights(pretrained.load("tiny-llama", load_in_4bit=True)[0])
    cfg = Config(model_name="tiny-llama", load_in_4bit=True, task_name="custom", train_file=str(train_file),
                 eval_file=str(eval_file), template=TEMPLATE, label_words=LABEL_WORDS, num_train=32, num_eval=8,
                 method=method, trainer=trainer, learning_rate=1e-3 if trainer == "regular" else 1e-4,
                 max_steps=4, xgblora_steps_per_iteration=2, per_device_train_batch_size=4, save_steps=2,
                 device="cpu", output_dir=str(tmp_path / "out"))
    captured = {}
    real_finish = loop.Trainer._finish

    def finish(self):  # the trained model, as the loop leaves it
        captured["model"] = self.run.model
        return real_finish(self)

    monkeypatch.setattr(loop.Trainer, "_finish", finish)
    result = run(cfg)
    model = captured["model"]
    assert torch.isfinite(torch.tensor(result["train_loss"]))
    after = {n.replace(".base", ""): w for n, w in _quantized_weights(model).items()}
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
    adapters = lora_modules(model)
    if method == "lora":
        assert any(m.lora_B.abs().max() > 0 for m in adapters.values())  # the adapters trained
    else:  # two boosters merged (the second at the last step): kept beside each 4-bit weight they touched
        assert result["boosters"] == 2 and any(m.merged_A is not None for m in adapters.values())


def test_full_fine_tuning_of_a_4bit_base_is_refused() -> None:
    with pytest.raises(UserError, match="full fine-tuning cannot update 4-bit weights"):
        Config(load_in_4bit=True, method="ft", trainer="regular")


def test_a_merge_into_a_4bit_base_for_export_is_refused_one_line() -> None:
    model, _ = pretrained.load("tiny-llama", load_in_4bit=True)
    attach(model, None, r=2, alpha=4)
    from xgblora.adapters.lora import unwrap

    with pytest.raises(UserError, match="4-bit base weight cannot take a merged adapter"):
        unwrap(model)
