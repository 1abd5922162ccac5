"""TRL's config names in an xgblora YAML config: the fields of TRL's SFTConfig (read by `xgblora train`), DPOConfig
(`xgblora dpo`), KTOConfig (`xgblora kto`), RewardConfig (`xgblora reward`), GRPOConfig and RLOOConfig (`xgblora
grpo`), transformers' TrainingArguments among them, that are no xgblora option of the same name. Each is mapped onto
xgblora's option, ignored with a one-line warning (logging, the Hub, data-loader workers, kernels: what trains stays
the same), or refused with what xgblora does instead (anything that would change what trains), unless its value is
one under which xgblora does what TRL does.

A static table, so that TRL stays out of the runtime dependencies; tests/test_trl_names.py checks it against the
installed TRL's dataclasses, and docs/trl.md shows it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from xgblora import config
from xgblora.errors import UserError

log = logging.getLogger("xgblora")
UNSET = (None, False, 0, "", [], {})  # the values that leave a TRL option off


@dataclass(frozen=True)
class Mapped:
    """A TRL option that is an xgblora option under another name, or with its values spelt otherwise: `convert`
    turns TRL's value into xgblora options and values (none where TRL's value is xgblora's behaviour already),
    raising ValueError for a value xgblora has no counterpart of. `options`: the options it may set."""

    options: tuple[str, ...]
    convert: Callable[[Any], dict[str, Any]]


@dataclass(frozen=True)
class Ignorable:
    """A TRL option that does not change what trains here: a warning names it, unless its value is in `accepted`."""

    reason: str
    accepted: tuple[Any, ...] = UNSET


@dataclass(frozen=True)
class Refused:
    """A TRL option that would change what trains, with no xgblora counterpart: refused with `reason` (what xgblora
    does instead), unless its value is in `accepted` (values under which xgblora does what TRL does)."""

    reason: str
    accepted: tuple[Any, ...] = UNSET


Entry = Mapped | Ignorable | Refused


def renamed(option: str) -> Mapped:
    return Mapped((option,), lambda value: {option: value})


def _flag(option: str, sense: bool = True) -> Mapped:
    """A TRL switch whose true (or, with sense False, false) value is xgblora's `option` true; null: the default."""
    def convert(value: Any) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, bool):
            raise ValueError(f"expected true, false or null, got {value!r}")
        return {option: value == sense}
    return Mapped((option,), convert)


def _assistant_only_loss(value: Any) -> dict[str, Any]:
    if value is False:  # TRL's default trains on a conversation's every token, xgblora's on its answers
        raise ValueError("false (TRL's default) puts the loss on every token of a conversation, where xgblora puts "
                         "it on the answers; for every token write train_on_prompt: true instead")
    return _flag("train_on_prompt", sense=False).convert(value)


def _text_field(value: Any) -> dict[str, Any]:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a column name, got {value!r}")
    return {} if value == "text" else {"columns": f"text={value}"}


def _optim(value: Any) -> dict[str, Any]:
    fused = {"adamw_torch_fused": True, "adamw_torch": False}
    if value not in fused:
        raise ValueError(f"{value!r}: xgblora trains with AdamW, adamw_torch_fused or adamw_torch (the fused_adamw "
                         f"option), or with MeZO's estimators under trainer: zo")
    return {"fused_adamw": fused[value]}


def _sampling(grouped: str | None) -> Mapped:
    """train_sampling_strategy: random is xgblora's seeded shuffle; `grouped`: the option group_by_length sets (None
    where the command draws in random order only)."""
    def convert(value: Any) -> dict[str, Any]:
        if value == "random":
            return {grouped: False} if grouped else {}
        if value == "group_by_length" and grouped:
            return {grouped: True}
        raise ValueError(f"{value!r}: xgblora draws every epoch in a seeded random order"
                         + (" (group_by_length: true groups similar lengths)" if grouped else ""))
    return Mapped((grouped,) if grouped else (), convert)


DTYPE_FLAGS = {"bfloat16": {"load_bfloat16": True}, "float16": {"load_float16": True}, "float32": {}}


def _model_init_kwargs(value: Any) -> dict[str, Any]:
    """TRL's from_pretrained arguments: the dtype, the attention backend and trust_remote_code have xgblora options."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping, got {value!r}")
    out: dict[str, Any] = {}
    for key, item in value.items():
        if key in ("dtype", "torch_dtype") and item in DTYPE_FLAGS:
            out.update(DTYPE_FLAGS[item])
        elif key in ("attn_implementation", "trust_remote_code"):
            out[key] = item
        else:
            raise ValueError(f"{key}: {item!r} has no xgblora option; xgblora loads the model in float32 unless "
                             f"load_bfloat16 or load_float16, with attn_implementation and trust_remote_code")
    return out


def _use_cpu(value: Any) -> dict[str, Any]:
    return {"device": "cpu"} if value is True else {}


def _warmup_steps(value: Any) -> dict[str, Any]:
    """transformers' warmup_steps is also a share of the steps when below 1: xgblora's warmup_ratio."""
    if isinstance(value, float) and 0 < value < 1:
        return {"warmup_ratio": value}
    return {"warmup_steps": int(value) if isinstance(value, float) and value.is_integer() else value}


def _report_to(value: Any) -> dict[str, Any]:
    return {"report_to": ",".join(value) if isinstance(value, list) else value}


def _label_names(value: Any) -> dict[str, Any]:
    if isinstance(value, list):  # TRL's: the batch keys that hold the labels; xgblora's: a MeZO task's class names
        raise ValueError("TRL's label_names, the batch keys that hold the labels, has no meaning here: xgblora "
                         "builds its own batches (its label_names, a string, names a task's classes)")
    return {"label_names": value}


def _scheduler(value: Any) -> dict[str, Any]:
    # xgblora's constant schedule warms up over warmup_steps, as transformers' constant_with_warmup does
    return {"lr_scheduler_type": "constant" if value == "constant_with_warmup" else value}


def _scale_rewards(value: Any) -> dict[str, Any]:
    return {"scale_rewards": {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value}


# ----------------------------------------------------------------------------- reasons, in xgblora's words

HUB = "xgblora writes the run to output_dir only (upload final/ with `hf upload`)"
LOGS = "xgblora logs every logging_steps to metrics.jsonl and the report_to trackers, from the main process"
LOADER = "xgblora tokenises the rows once before training and collates batches in the main process"
EVALUATION = "xgblora's evaluation computes its own metrics (each command's docs name them)"
PARALLEL = ("xgblora sets up data parallelism itself under torchrun or accelerate launch (NCCL on GPUs, gloo on "
            "the CPU; FSDP through accelerate's config: docs/multi-gpu.md)")
KERNELS = "xgblora picks its kernels itself (its loss is chunked; compile: true compiles with torch's defaults)"
MODEL_LOADING = ("xgblora loads the model itself: load_bfloat16, load_float16, attn_implementation, "
                 "trust_remote_code, load_in_4bit")
OPTIMIZER = "xgblora trains with AdamW (fused_adamw picks its kernel) or MeZO's estimators (trainer: zo)"
TOKENS = "xgblora uses the tokenizer's own special tokens and the chat template's end of turn"
REFERENCE = "the reference stays the starting model"
VLLM = "read only with use_vllm; xgblora samples with its own shared-prefix sampler"
LABEL_KEYS = "TRL's label_names, the batch keys that hold the labels, has no meaning here: xgblora builds its own batches"
NO_USE = "TRL's trainers do not read it either"

COMMON: dict[str, Entry] = {  # transformers' TrainingArguments
    "lr_scheduler_kwargs": Refused("the schedules (lr_scheduler_type constant, linear, cosine) take no arguments"),
    "optim": Mapped(("fused_adamw",), _optim),
    "optim_args": Refused(OPTIMIZER),
    "optim_target_modules": Refused(OPTIMIZER),
    "average_tokens_across_devices": Refused(
        "data-parallel processes weigh alike in xgblora's loss, each its own tokens' mean", (False,)),
    "label_smoothing_factor": Refused("xgblora's token losses have no label smoothing"),
    "bf16_full_eval": Ignorable("evaluation runs in the training precision (bf16 or fp16 autocast)"),
    "fp16_full_eval": Ignorable("evaluation runs in the training precision (bf16 or fp16 autocast)"),
    "activation_checkpointing": renamed("gradient_checkpointing"),
    "activation_checkpointing_kwargs": Ignorable("xgblora recomputes every layer, non-reentrant"),
    "gradient_checkpointing_kwargs": Ignorable("xgblora recomputes every layer, non-reentrant"),
    "torch_compile": renamed("compile"),
    "torch_compile_backend": Ignorable(KERNELS),
    "torch_compile_mode": Ignorable(KERNELS),
    "liger_kernel_config": Ignorable(KERNELS),
    "use_cache": Ignorable("xgblora's training forwards keep no cache beyond a prompt's, shared by its completions"),
    "neftune_noise_alpha": Refused("xgblora adds no NEFTune noise to the embeddings"),
    "torch_empty_cache_steps": Ignorable("xgblora leaves the CUDA cache to torch"),
    "auto_find_batch_size": Refused("the batch is per_device_train_batch_size; out of memory, xgblora stops and "
                                    "names what to lower"),
    "logging_strategy": Ignorable(LOGS),
    "logging_first_step": Ignorable(LOGS),
    "log_on_each_node": Ignorable(LOGS),
    "logging_nan_inf_filter": Ignorable(LOGS + "; a NaN loss follows nan_policy"),
    "include_num_input_tokens_seen": Ignorable(LOGS),
    "log_level": Ignorable(LOGS),
    "log_level_replica": Ignorable(LOGS),
    "disable_tqdm": Ignorable(LOGS + "; the progress bar shows on a terminal only"),
    "run_name": Ignorable(LOGS + "; trackers name the run after output_dir"),
    "project": Ignorable(LOGS),
    "trackio_space_id": Ignorable(HUB),
    "trackio_bucket_id": Ignorable(HUB),
    "trackio_static_space_id": Ignorable(HUB),
    "eval_delay": Refused("xgblora evaluates every eval_steps from the first step on"),
    "prediction_loss_only": Ignorable(EVALUATION),
    "eval_do_concat_batches": Ignorable(EVALUATION),
    "eval_use_gather_object": Ignorable(EVALUATION),
    "eval_accumulation_steps": Ignorable(EVALUATION),
    "include_for_metrics": Ignorable(EVALUATION),
    "batch_eval_metrics": Ignorable(EVALUATION),
    "save_on_each_node": Ignorable("the main process writes the checkpoints"),
    "enable_jit_checkpoint": Ignorable("xgblora saves a checkpoint when SIGINT or SIGTERM stops it"),
    "push_to_hub": Ignorable(HUB),
    "hub_token": Ignorable(HUB),
    "hub_private_repo": Ignorable(HUB),
    "hub_model_id": Ignorable(HUB),
    "hub_strategy": Ignorable(HUB),
    "hub_always_push": Ignorable(HUB),
    "hub_revision": Ignorable(HUB),
    "metric_for_best_model": Refused("load_best_model_at_end keeps the step with the best first metric of "
                                     "xgblora's evaluation (each command's docs name it)"),
    "greater_is_better": Refused("load_best_model_at_end keeps the step with the best first metric of xgblora's "
                                 "evaluation (each command's docs name it)"),
    "ignore_data_skip": Refused("a resumed run continues the data order where it stopped"),
    "restore_callback_states_from_checkpoint": Ignorable("xgblora has no callbacks"),
    "full_determinism": Ignorable("xgblora seeds every generator from seed, without deterministic kernels"),
    "data_seed": Refused("the data order follows seed (train_set_seed draws a MeZO task's examples)"),
    "use_cpu": Mapped(("device",), _use_cpu),
    "accelerator_config": Refused(PARALLEL),
    "parallelism_config": Refused(PARALLEL),
    "fsdp": Refused(PARALLEL),
    "fsdp_config": Refused(PARALLEL),
    "deepspeed": Refused(PARALLEL),
    "dataloader_drop_last": Refused("xgblora trains on an epoch's last, smaller batch too"),
    "dataloader_num_workers": Ignorable(LOADER),
    "dataloader_pin_memory": Ignorable(LOADER),
    "dataloader_persistent_workers": Ignorable(LOADER),
    "dataloader_prefetch_factor": Ignorable(LOADER),
    "dataloader_multiprocessing_context": Ignorable(LOADER),
    "dataloader_in_order": Ignorable(LOADER),
    "remove_unused_columns": Ignorable("xgblora reads the columns it needs (columns: maps other names)"),
    "train_sampling_strategy": _sampling("group_by_length"),
    "length_column_name": Ignorable("xgblora measures the lengths itself"),
    "ddp_find_unused_parameters": Ignorable(PARALLEL),
    "ddp_bucket_cap_mb": Ignorable(PARALLEL),
    "ddp_broadcast_buffers": Ignorable(PARALLEL),
    "ddp_static_graph": Ignorable(PARALLEL),
    "ddp_backend": Ignorable(PARALLEL),
    "debug": Ignorable("xgblora has no such debug switches (nan_policy stops at a NaN loss)"),
    "skip_memory_metrics": Ignorable("results.json always holds the peak memory"),
    "do_train": Ignorable(NO_USE),
    "do_eval": Ignorable(NO_USE),
    "do_predict": Ignorable(NO_USE),
    "local_rank": Ignorable("torchrun and accelerate launch set the rank"),
    # xgblora's own names whose values TRL spells otherwise, or means otherwise
    "warmup_steps": Mapped(("warmup_steps", "warmup_ratio"), _warmup_steps),
    "report_to": Mapped(("report_to",), _report_to),
    "lr_scheduler_type": Mapped(("lr_scheduler_type",), _scheduler),
}

# What SFTConfig, DPOConfig, KTOConfig and GRPOConfig add to TrainingArguments, or read otherwise.
MODEL_OPTIONS: dict[str, Entry] = {  # all four
    "model_init_kwargs": Mapped(("load_bfloat16", "load_float16", "attn_implementation", "trust_remote_code"),
                                _model_init_kwargs),
    "router_aux_loss_coef": Refused("xgblora adds no router loss to a mixture of experts' loss"),
    "pad_to_multiple_of": Ignorable("xgblora pads each batch to its longest row"),
}
DATASET_OPTIONS: dict[str, Entry] = {  # SFTConfig and DPOConfig
    "dataset_num_proc": Ignorable(LOADER),
    "pad_token": Refused(TOKENS),
}

SFT: dict[str, Entry] = {
    **MODEL_OPTIONS,
    **DATASET_OPTIONS,
    "label_names": Mapped(("label_names",), _label_names),
    "chat_template_path": renamed("chat_template"),
    "dataset_text_field": Mapped(("columns",), _text_field),
    "dataset_kwargs": Refused("xgblora prepares the rows itself, from their fields (docs/chat-sft.md)"),
    "eos_token": Refused(TOKENS),
    "truncation_mode": Refused("xgblora cuts a long row from the left (keep_end), so that the answer stays",
                               ("keep_end",)),
    "shuffle_dataset": Ignorable("xgblora draws every epoch in a seeded random order", (False, True)),
    "packing_strategy": Ignorable("xgblora's packing lays a batch's rows end to end in one row (TRL's "
                                  "padding_free); it does not regroup rows into max_length blocks"),
    "padding_free": renamed("packing"),
    "eval_packing": Ignorable("evaluation batches are padded"),
    "completion_only_loss": _flag("train_on_prompt", sense=False),
    "assistant_only_loss": Mapped(("train_on_prompt",), _assistant_only_loss),
    "loss_type": Refused("xgblora's SFT loss is the negative log-likelihood (loss_mean: its average)", ("nll",)),
}

DPO: dict[str, Entry] = {
    **MODEL_OPTIONS,
    **DATASET_OPTIONS,
    "truncation_mode": Refused("max_length cuts prompt and completion at the end (keep_start)", ("keep_start",)),
    "padding_free": Ignorable("a pair's completions share its prompt's forward instead"),
    "ld_alpha": Refused("xgblora weighs every completion token alike (no LD-DPO)"),
    "f_divergence_type": Refused("xgblora's losses take the reverse KL's log ratios", ("reverse_kl",)),
    "f_alpha_divergence_coef": Ignorable("read only with f_divergence_type alpha_divergence, which xgblora lacks"),
    "use_weighting": Refused("xgblora weighs every pair alike (no WPO weighting)"),
    "discopop_tau": Ignorable("read only by loss_type discopop, which xgblora lacks"),
    "sync_ref_model": Refused(REFERENCE),
    "ref_model_mixup_alpha": Ignorable("read only with sync_ref_model; " + REFERENCE),
    "ref_model_sync_steps": Ignorable("read only with sync_ref_model; " + REFERENCE),
    "train_sampling_strategy": _sampling("group_by_length"),
    "average_tokens_across_devices": Ignorable("the loss is a mean over pairs", (True, False)),
    "label_names": Refused(LABEL_KEYS),
}

KTO: dict[str, Entry] = {
    **MODEL_OPTIONS,
    "dataset_num_proc": Ignorable(LOADER),
    "sync_ref_model": Refused(REFERENCE),
    "ref_model_mixup_alpha": Ignorable("read only with sync_ref_model; " + REFERENCE),
    "ref_model_sync_steps": Ignorable("read only with sync_ref_model; " + REFERENCE),
    "label_names": Refused(LABEL_KEYS),
}

GRPO: dict[str, Entry] = {
    **MODEL_OPTIONS,
    "cast_lm_head_to_fp32": Refused("the LM head runs in the model's dtype (float32 unless load_bfloat16 or "
                                    "load_float16)"),
    "num_generations_eval": Refused("held-out prompts get one greedy completion each (pass@1)"),
    "ds3_gather_for_generation": Ignorable("read only under DeepSpeed ZeRO-3, which xgblora does not run"),
    "shuffle_dataset": Refused("xgblora draws the prompts in a seeded random order every epoch", (True,)),
    "top_k": Refused("xgblora samples with temperature and top_p only", (None, 0)),
    "min_p": Refused("xgblora samples with temperature and top_p only"),
    "generation_kwargs": Refused("xgblora samples with temperature and top_p only"),
    "repetition_penalty": Refused("xgblora samples with temperature and top_p only", (1.0,)),
    "chat_template_kwargs": Refused("chat_template: FILE replaces the tokenizer's template"),
    "cache_implementation": Ignorable("xgblora's sampler keeps its own cache, shared by a prompt's completions"),
    "use_vllm": Refused("xgblora samples with its own shared-prefix sampler"),
    **{name: Ignorable(VLLM) for name in (
        "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex",
        "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
        "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size",
        "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
        "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap")},
    "delta": Refused("xgblora clips the ratio within [1 - epsilon, 1 + epsilon_high] only (no two-sided delta)"),
    **{name: Ignorable("read only by loss_type sapo or vespo, which xgblora lacks") for name in (
        "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
        "vespo_lambda_neg")},
    "sync_ref_model": Refused(REFERENCE),
    "ref_model_mixup_alpha": Ignorable("read only with sync_ref_model; " + REFERENCE),
    "ref_model_sync_steps": Ignorable("read only with sync_ref_model; " + REFERENCE),
    "top_entropy_quantile": Refused("every completion token carries loss (no entropy masking)", (1.0,)),
    "entropy_coef": Refused("xgblora's GRPO loss has no entropy bonus"),
    "use_adaptive_entropy": Refused("xgblora's GRPO loss has no entropy bonus"),
    **{name: Ignorable("read only with use_adaptive_entropy, which xgblora lacks") for name in (
        "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target")},
    "off_policy_mask_threshold": Refused("xgblora masks no off-policy sequences"),
    "log_multimodal": Ignorable(LOGS),
    "num_completions_to_print": Ignorable(LOGS + " (log_completions: a few completions per logging step)"),
    "log_unique_prompts": Ignorable(LOGS),
    "log_completions_hub_repo": Ignorable(HUB),
    "use_transformers_continuous_batching": Ignorable("xgblora samples with its own shared-prefix sampler"),
    "transformers_continuous_batching_config": Ignorable("xgblora samples with its own shared-prefix sampler"),
    "use_transformers_paged": Ignorable("xgblora samples with its own shared-prefix sampler"),
    "train_sampling_strategy": _sampling(None),
    "scale_rewards": Mapped(("scale_rewards",), _scale_rewards),
    "average_tokens_across_devices": Ignorable("policy_loss sets how tokens count over processes", (True, False)),
    "label_names": Refused(LABEL_KEYS),
}

REWARD: dict[str, Entry] = {
    "model_init_kwargs": MODEL_OPTIONS["model_init_kwargs"],
    "pad_to_multiple_of": MODEL_OPTIONS["pad_to_multiple_of"],
    **DATASET_OPTIONS,
    "chat_template_path": renamed("chat_template"),
    "eos_token": Refused(TOKENS),
    "label_names": Refused(LABEL_KEYS),
}

# RLOOConfig's names are GRPOConfig's, less these (its normalize_advantages and reward_clip_range are xgblora's
# own): an RLOOConfig YAML runs under xgblora grpo, with advantage_estimator: rloo
GRPO_ONLY = ("cast_lm_head_to_fp32", "delta", "entropy_coef", "entropy_coef_delta", "entropy_coef_max",
             "entropy_coef_min", "entropy_target", "log_completions_hub_repo",
             "off_policy_mask_threshold", "sapo_temperature_neg", "sapo_temperature_pos", "scale_rewards",
             "top_entropy_quantile", "use_adaptive_entropy", "vespo_k_neg", "vespo_k_pos", "vespo_lambda_neg",
             "vespo_lambda_pos", "vllm_importance_sampling_cap", "vllm_importance_sampling_clip_max",
             "vllm_importance_sampling_clip_min", "vllm_importance_sampling_correction",
             "vllm_importance_sampling_mode")
RLOO = {name: entry for name, entry in GRPO.items() if name not in GRPO_ONLY}

TABLES = {"SFTConfig": {**COMMON, **SFT}, "DPOConfig": {**COMMON, **DPO}, "GRPOConfig": {**COMMON, **GRPO},
          "KTOConfig": {**COMMON, **KTO}, "RLOOConfig": {**COMMON, **RLOO}, "RewardConfig": {**COMMON, **REWARD}}

# Which TRL config an options class reads YAML keys of: the first of these among its bases (train, eval, mezo,
# compare and rft take SFTConfig's; grpo's, GRPOConfig's, takes every key of RLOOConfig too).
TRL_CONFIGS = ((config.GRPOConfig, "GRPOConfig"), (config.DPOConfig, "DPOConfig"), (config.KTOConfig, "KTOConfig"),
               (config.RewardConfig, "RewardConfig"), (config.TaskTrainingOptions, "SFTConfig"),
               (config.EvalConfig, "SFTConfig"), (config.RFTConfig, "SFTConfig"))


def table_for(cls: type) -> dict[str, Entry]:
    """The TRL names an options class takes in a YAML config (none for chat and generate)."""
    return next((TABLES[name] for base, name in TRL_CONFIGS if issubclass(cls, base)), {})


def resolve(entry: Entry, key: str, value: Any, path: str) -> dict[str, Any]:
    """The xgblora options and values a TRL key of a YAML config stands for: a mapped key's, none for an ignored
    one (with a warning unless its value is one of its accepted ones); a refused key, or a value xgblora has no
    counterpart of, is a one-line UserError."""
    if isinstance(entry, Mapped):
        try:
            return entry.convert(value)
        except (TypeError, ValueError) as exc:
            raise UserError(f"{path}: key {key!r} (TRL's): {exc}") from None
    if _accepted(value, entry.accepted):
        return {}
    if isinstance(entry, Refused):
        raise UserError(f"{path}: key {key!r} is TRL's, and {value!r} would change what trains: {entry.reason}; "
                        f"remove the key")
    log.warning("%s: key %r is TRL's and is ignored: %s", path, key, entry.reason)
    return {}


def _accepted(value: Any, accepted: tuple[Any, ...]) -> bool:
    # 1 == True and 0 == False in Python: a number is accepted only as a number, a switch only as a switch
    return any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in accepted)
