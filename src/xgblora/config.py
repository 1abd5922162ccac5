"""Every option of a run as dataclasses; command-line and YAML parsing with MeZO's flag names; validation."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from xgblora.errors import UserError
from xgblora.trackers import parse_report_to

log = logging.getLogger("xgblora")

# The paper's Eq. 7 adds lambda (|A|^2 + |B|^2) to each booster's loss; its value for our models is not in the text
# we could read, so it is a small one that changes little (see README). The booster counts are ours too.
PAPER_NORM_PENALTY = 1e-3
# MeZO's protocol draws 1000 training examples from a task's train split; a user's own data uses every row.
MEZO_NUM_TRAIN = 1000
# Boosters per run when neither --xgblora_num_boosters nor --xgblora_steps_per_iteration is given, per preset. plain
# (the default) is the measured best: more boosters on every layer beat the paper's third of the layers at equal
# steps where rank limits and on SmolLM2, and tie on MiniLM SST-2 (BENCHMARKS.md, "XGBLoRA's preset").
PRESET_BOOSTERS = {"paper": 5, "plain": 25}
ZO_ESTIMATORS = ("mezo", "fzoo", "svrg", "nspsa", "es")
GGUF_SUFFIX = ".gguf"


def is_gguf(name_or_path: str) -> bool:
    """Whether a model name names a GGUF file (a local path, or owner/repo/FILE.gguf on the hub)."""
    return name_or_path.lower().endswith(GGUF_SUFFIX)


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None, aliases: tuple[str, ...] = ()) -> Any:
    meta = {"help": help, "choices": choices, "aliases": aliases}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class DataOptions:
    """What data/ reads of a run's options: where the rows are, how their columns map, and how many examples each
    split draws (MeZO's protocol for its tasks, every row of the user's own). `Config.data` builds it; the flags and
    their help live on Config."""

    task_name: str = "SST2"
    data_dir: str | None = None
    train_file: str | None = None
    eval_file: str | None = None
    columns: str | None = None
    data_format: str = "auto"
    template: str | None = None
    label_words: str | None = None
    label_names: str | None = None
    num_train: int | None = None
    num_dev: int | None = None
    eval_split_ratio: float | None = None
    num_eval: int | None = None
    train_set_seed: int = 0
    dev_pool: str = "any"
    objective: str = "lm"
    evaluation_only: bool = False  # --trainer none: an --eval_file is enough


@dataclass(frozen=True)
class ModelOptions:
    """Which model to load and how: the options every command that loads a model shares."""

    model_name: str = _opt("tiny-opt", "Hub id, local path, a GGUF file (FILE.gguf, dequantised once and cached), pkg:<package>, or a built-in random model (tiny-opt, tiny-llama, opt-125m-random, ...).")
    gguf_file: str | None = _opt(None, "A GGUF file inside the --model_name folder (or hub repository): the same as --model_name FOLDER/FILE.gguf.")
    load_float16: bool = _opt(False, "Load the weights in float16.")
    load_bfloat16: bool = _opt(False, "Load the weights in bfloat16.")
    attn_implementation: str = _opt("auto", "Attention backend: auto picks flash_attention_2 on CUDA when installed, else sdpa.",
                                    ("auto", "sdpa", "eager", "flash_attention_2"))
    trust_remote_code: bool = _opt(False, "Allow a hub model to run its own code (off unless you pass it).")
    adapter: str | None = _opt(None, "A PEFT LoRA adapter folder (trained with PEFT or xgblora) or an xgblora run folder, applied on --model_name. train: continue training it (its modules, rank and scaling; XGBLoRA merges it as the first booster); eval, generate, chat: use the model with it; rft: the first round samples with it and trains it on. --model_name may also name an adapter folder or a run folder itself.")
    load_in_4bit: bool = _opt(False, "QLoRA: the base model's linear layers in 4-bit NF4 with double quantisation (bitsandbytes), their matmuls in the autocast dtype (else the weights' dtype); the adapters stay fp32. Training: --method lora or xgblora.")
    device: str = _opt("auto", "cpu, cuda, cuda:N, or auto (cuda when available).")

    def resolve_gguf_file(self) -> None:
        """Fold --gguf_file into --model_name, a local GGUF path made absolute: the one name config.yaml and a
        trained adapter record, so eval, generate and export find the same base from any directory."""
        if self.gguf_file is not None:  # a local folder's file by its absolute path, a hub repository's as repo/FILE
            folder = Path(self.model_name).expanduser()
            name = str(folder / self.gguf_file) if folder.is_dir() else f"{self.model_name.rstrip('/')}/{self.gguf_file}"
            object.__setattr__(self, "model_name", name)  # frozen: resolved once, while the object is built
            object.__setattr__(self, "gguf_file", None)
        path = Path(self.model_name).expanduser()
        if is_gguf(self.model_name) and path.is_file():
            object.__setattr__(self, "model_name", str(path.resolve()))

    @property
    def dtype_name(self) -> str:
        """Weight dtype as a torch dtype name."""
        return "float16" if self.load_float16 else "bfloat16" if self.load_bfloat16 else "float32"


@dataclass(frozen=True)
class Config(ModelOptions):
    """Options of `xgblora train` and `xgblora eval`; names follow MeZO's run.py and the XGBLoRA fork."""

    head: str = _opt("auto", "What scores the labels: lm (a causal LM's candidate tokens), classifier (a new sequence-classification head, trained in every method), mlm (a masked LM's one-token label words at a mask, MeZO's encoder prompts); auto: lm for causal LMs, mlm for encoders saved with their MLM head, else classifier.",
                     ("auto", "lm", "classifier", "mlm"))
    pooling: str = _opt("auto", "What a classifier head reads: cls (the model's own head: [CLS] through its pooler, or a causal LM's last token), mean (the masked mean of the last hidden states), last (the last non-padding token); auto: what the model's sentence-transformers pooling config (1_Pooling/config.json) says, else cls. Embeddings (--objective contrastive/grit) read cls as the first token's hidden state; their auto falls back to mean for encoders and bidirectional causal LMs, last for causal ones.",
                        ("auto", "cls", "mean", "last"))
    head_init: str = _opt("probe", "How a new classifier head starts: probe (a logistic regression fitted by L-BFGS on the frozen model's features of the training examples, seconds) or random.",
                          ("probe", "random"))
    head_probe_l2: float | None = _opt(None, "L2 strength of the --head_init probe's logistic regression (default: chosen by k-fold cross-validation on the training examples from head.PROBE_L2_GRID, 1e-3 to 3e-1, k = head.PROBE_FOLDS = 5).")
    head_trainer: str = _opt("first-order", "Under --trainer zo, how a new classifier head trains: first-order (AdamW on the features MeZO's forwards computed, detached: inference memory, and the dual batch still applies), frozen (the head stays as initialised), or zo (perturbed with the body).",
                             ("first-order", "frozen", "zo"))
    head_learning_rate: float = _opt(1e-3, "AdamW learning rate of a first-order head under --trainer zo (constant).")
    # task and data
    task_name: str = _opt("SST2", "SST2, RTE, CB, BoolQ, Copa, WIC, WSC, MultiRC, ReCoRD, SQuAD, DROP, or custom.")
    data_dir: str | None = _opt(None, "Folder with <task>/{train,dev}.jsonl in GLUE/SuperGLUE field names (else HF datasets).")
    train_file: str | None = _opt(None, "Custom task: training data: JSON/JSONL, CSV/TSV, parquet, arrow, a save_to_disk folder, or a dataset id.")
    eval_file: str | None = _opt(None, "Your own data: the evaluation rows, in any form --train_file takes; with no dev split, also what --evaluation_strategy steps and --load_best_model_at_end watch. Without it: the rows --num_train N did not draw, or no evaluation when every row trains.")
    columns: str | None = _opt(None, "Custom task: map your column names to ours, OURS=THEIRS,... (e.g. prompt=question,completion=answer).")
    data_format: str = _opt("auto", "Custom instruction data: messages (chat turns), prompt_completion (also prompt/response; a conversational prompt/completion is a chat), text (language modelling); auto: from each row's fields.",
                            ("auto", "messages", "prompt_completion", "text"))
    chat_template: str | None = _opt(None, "A Jinja chat template file, replacing the tokenizer's (conversation rows need one).")
    train_on_prompt: bool = _opt(False, "Instruction data: the prompt (user and system turns) carries loss too, not only the answers.")
    loss_mean: str = _opt("auto", "Loss of a batch: the mean over its target tokens (token) or of each example's mean (example); auto: token for instruction data, example for MeZO's tasks.",
                          ("auto", "token", "example"))
    template: str | None = _opt(None, "Custom classification task: prompt template with {field} slots, e.g. '{text} It was'.")
    label_words: str | None = _opt(None, "Custom classification task: comma-separated verbalizers, one per label, in label order.")
    label_names: str | None = _opt(None, "Custom classification task: comma-separated label values as they appear in the file (default 0,1,...).")
    num_train: int | None = _opt(None, "Training examples drawn from the train split (demonstrations when --trainer none). Default: every row of your own data (--train_file, --objective contrastive/grit); 1000 for MeZO's tasks (MeZO's protocol).")
    num_dev: int | None = _opt(None, "Dev examples drawn from the train split (disjoint from the training ones); none unless given. The dev split is what --evaluation_strategy steps and --load_best_model_at_end read.")
    eval_split_ratio: float | None = _opt(None, "Your own data: hold out this fraction of --train_file's rows as the dev split (instead of --num_dev N).")
    num_eval: int | None = _opt(None, "Evaluation examples drawn from the validation split (all when unset).")
    train_set_seed: int = _opt(0, "Seed of the train/dev sampling.")
    dev_pool: str = _opt("any", "Which train-split examples the dev set is drawn from: any, or sentences (inputs with at least 8 words and a sentence-final . ! or ?: SST-2's train split is mostly phrases, its validation split full sentences).",
                         ("any", "sentences"))
    max_length: int = _opt(2048, "Longest input in tokens; longer inputs are truncated from the left.")
    max_new_tokens: int = _opt(50, "Generation tasks: most tokens to generate.")
    sfc: bool = _opt(False, "Calibrate candidate scores with surface-form competition (SFC).")
    icl_sfc: bool = _opt(False, "SFC with the demonstrations in the calibration prompt.")
    only_train_option: bool = _opt(True, "MeZO's tasks on a causal LM: the loss is on the gold candidate's tokens only (false: on every token of prompt and candidate, as MeZO's run.py). Instruction data: see --train_on_prompt.")
    train_as_classification: bool = _opt(False, "Train with cross-entropy over the candidates.")
    # embedding models (pair data): contrastive training and GRIT
    objective: str = _opt("lm", "What the model learns: lm (the task's own loss: answer tokens, candidates or labels), contrastive (an embedding model: InfoNCE over query/positive pairs with in-batch and hard negatives; --train_file rows of query, positive and optional negative(s)), grit (a causal LM that embeds and generates: contrastive on --train_file pairs plus the language-modelling loss on --grit_train_file instruction rows).",
                          ("lm", "contrastive", "grit"))
    query_instruction: str = _opt("", "Contrastive/GRIT: text put before every query (e.g. 'query: '); with --instruction_format gritlm the task instruction that GritLM's format wraps.")
    doc_instruction: str = _opt("", "Contrastive/GRIT: text put before every document (e.g. 'passage: '); with --instruction_format gritlm wrapped the same way.")
    instruction_format: str = _opt("plain", "Contrastive/GRIT: plain (the instructions as they are) or gritlm (GritLM's format: '<|user|>\\n{instruction}\\n<|embed|>\\n', or '<|embed|>\\n' without an instruction, for queries and documents alike).",
                                   ("plain", "gritlm"))
    include_prompt: bool | None = _opt(None, "Contrastive/GRIT: the instruction's tokens count in the mean pooling (sentence-transformers' Pooling include_prompt); they are always attended to. Default: off for grit (GritLM pools the text only), on for contrastive.")
    contrastive_temperature: float | None = _opt(None, "Contrastive/GRIT: softmax temperature of the cosine similarities. Default: 0.02 for grit (GritLM's), 0.05 for contrastive (sentence-transformers' scale 20).",
                                                 aliases=("temperature",))
    contrastive_loss: str = _opt("infonce", "Contrastive: infonce (each query against all documents: sentence-transformers' MultipleNegativesRankingLoss) or symmetric (also each positive against all queries, the two averaged: MultipleNegativesSymmetricRankingLoss).",
                                 ("infonce", "symmetric"))
    learnable_temperature: bool = _opt(False, "Contrastive: learn the temperature (as CLIP does, its log-scale trained by AdamW from --contrastive_temperature).")
    mini_batch_size: int = _opt(0, "Contrastive/GRIT: gradient caching (GradCache): embed the batch this many rows at a time, without a graph, and back-propagate each mini-batch from the gradients of the whole batch's loss: every query keeps the whole batch's negatives at the memory of one mini-batch (the same loss and gradients). 0: the batch in one piece.")
    embed_pieces: bool | None = _opt(None, "Contrastive/GRIT without gradient caching: embed a batch's queries and documents in length-sorted pieces, each padded only to its own longest row, where that saves more than a forward costs (the same embeddings, loss and gradients; fewer padding tokens). Default: on for the CPU, off on CUDA, where smaller pieces may under-fill the GPU.")
    bidirectional: bool | None = _opt(None, "Contrastive/GRIT with a causal LM: the embedding pass attends both ways (GritLM); default on for grit (the model must allow it: checked, and --attn_implementation auto picks sdpa), off for contrastive.")
    grit_train_file: str | None = _opt(None, "GRIT: instruction data for the generative loss, in any form --train_file takes (messages, prompt/completion, text).")
    grit_contrastive_weight: float = _opt(1.0, "GRIT: weight of the contrastive loss.")
    grit_generative_weight: float = _opt(1.0, "GRIT: weight of the generative loss.")
    grit_generative_batch_size: int | None = _opt(None, "GRIT: instruction examples per batch for the generative loss (GritLM's per_device_generative_bs; default: --per_device_train_batch_size, one per pair).")
    # method
    method: str = _opt("ft", "What trains: full fine-tuning, LoRA, or XGBLoRA boosters.", ("ft", "lora", "xgblora"))
    lora: bool = _opt(False, "Same as --method lora (MeZO's flag).")
    xgblora: bool = _opt(False, "Same as --method xgblora (the XGBLoRA fork's flag).")
    lora_r: int | None = _opt(None, "Adapter rank (default 8 for LoRA, 1 for XGBLoRA).", aliases=("lora_rank",))
    lora_alpha: float | None = _opt(None, "Adapter scaling numerator: delta = (alpha / r) B A. Default 2r, so alpha / r = 2 at every rank (MeZO's r=8, alpha=16); with --use_rslora 2 sqrt(8), the same scale as LoRA's at r=8.")
    use_rslora: bool = _opt(False, "rsLoRA scaling: delta = (alpha / sqrt(r)) B A.")
    lora_dropout: float = _opt(0.0, "Dropout on the adapter branch's input.")
    lora_target_modules: str | None = _opt(None, "What to adapt, as PEFT's target_modules: comma-separated module-name suffixes (q_proj,v_proj), all-linear (every linear layer of the transformer blocks; never the LM head or a classifier head), or a regular expression matched against the whole module name. Default: the attention query and value (MeZO's and the LoRA paper's choice).")
    xgblora_preset: str = _opt("plain", "XGBLoRA defaults: plain (25 boosters, each on every layer, no penalty: the measured best) or paper (arXiv 2410.19694: 5 boosters, each on a random third of the layers, a norm penalty on A and B). Both merge with alpha_t = 1. Explicit flags win.",
                               ("paper", "plain"))
    xgblora_num_boosters: int | None = _opt(None, "Boosters T in a run: each trains max_steps / T steps (default 25 under the plain preset, 5 under paper; --xgblora_steps_per_iteration wins).")
    xgblora_steps_per_iteration: int | None = _opt(None, "Steps per booster before it is merged and re-initialised (default max_steps / --xgblora_num_boosters).")
    xgblora_layers_per_booster: int | None = _opt(None, "Random subset of layers that carries the booster each iteration (default: a third of them, at least 1, under the paper preset; all under plain).")
    xgblora_shrinkage: float = _opt(1.0, "Merge step size alpha_t: W += alpha_t * delta (the paper's 1).")
    xgblora_norm_penalty: float | None = _opt(None, "lambda in lambda * (|A|^2 + |B|^2) added to the loss (default 1e-3 under the paper preset, 0 under plain).")
    xgblora_restart_schedule: bool = _opt(False, "Run the learning-rate schedule (warm-up and decay) anew for every booster, over its steps.")
    xgblora_init: str = _opt("random", "Where each booster starts: random (A Kaiming-uniform, B = 0, as LoRA) or gradient (A = the leading right singular vectors of the gradient of each adapted weight over --xgblora_init_batches training batches, B = 0: its first step follows the gradient's best rank-r direction; --trainer regular only).", ("gradient", "random"))
    xgblora_init_batches: int = _opt(1, "--xgblora_init gradient: training batches (one forward and backward each, beside the training steps) whose gradient starts each booster.")
    xgblora_adaptive: bool = _opt(False, "The Boosting-LoRA-ZO fork's extension (not the paper's): merge when the loss EMA stops improving, at the latest after --xgblora_adaptive_max_steps.")
    xgblora_adaptive_max_steps: int | None = _opt(None, "Adaptive merge: most steps one booster trains (default: the steps per booster of the fixed schedule).")
    xgblora_adaptive_patience: int = _opt(50, "Adaptive merge: steps without improvement before merging.")
    xgblora_adaptive_threshold: float = _opt(1e-3, "Adaptive merge: relative improvement of the loss EMA that counts.")
    xgblora_adaptive_ema: float = _opt(0.9, "Adaptive merge: EMA decay of the training loss.")
    # optimisation
    trainer: str = _opt("regular", "regular (AdamW), zo (MeZO), or none (evaluate only: what `xgblora eval` runs).", ("none", "regular", "zo"))
    learning_rate: float = _opt(1e-5, "Peak learning rate.")
    zo_eps: float = _opt(1e-3, "MeZO perturbation size epsilon.")
    zo_dual: bool | None = _opt(None, "ZO with adapters: both perturbed losses of a two-point estimate from one forward over a doubled batch (default: on where it applies: adapters with mezo, nspsa, svrg or es).")
    zo_estimator: str = _opt("mezo", "Zeroth-order gradient estimator: mezo (two-point SPSA, 2 forwards/step), nspsa (mean of --zo_queries two-point estimates), fzoo (--zo_queries one-sided Rademacher estimates over their std, queries+1 forwards), svrg (MeZO-SVRG: large-batch anchor every --zo_svrg_period steps, 4 forwards between), es (evolution strategies: --zo_queries antithetic pairs, losses z-scored over the population).", ZO_ESTIMATORS)
    zo_queries: int | None = _opt(None, "Perturbations per step: nspsa's two-point estimates (default 4), fzoo's one-sided ones (default 8), es's antithetic pairs (default 15: a population of 30); mezo and svrg use 1.")
    zo_optimizer: str = _opt("sgd", "What the ZO estimate drives: sgd (in place, no state), momentum (torch SGD, --adam_beta1 as momentum), adam (torch AdamW); the last two keep fp32 state as large as the trainable weights.", ("sgd", "momentum", "adam"))
    zo_svrg_period: int = _opt(10, "svrg: steps from one anchor step to the next.")
    zo_svrg_anchor_batches: int = _opt(8, "svrg: training batches the anchor step's large-batch estimate averages (2 forwards each).")
    zo_svrg_anchor_learning_rate: float | None = _opt(None, "svrg: the anchor (large-batch) step's rate, MeZO-SVRG's eta_1 (its script: 1e-3), --learning_rate being the steps between, eta_2 (1e-6); scheduled as --learning_rate is (default: --learning_rate).")
    zo_stochastic_rounding: bool | None = _opt(None, "MeZO full-model update in half precision with stochastic rounding (default on in bf16/fp16).")
    per_device_train_batch_size: int = _opt(8, "Training micro-batch size per device.")
    per_device_eval_batch_size: int = _opt(8, "Evaluation batch size (in (example, candidate) pairs).")
    gradient_accumulation_steps: int = _opt(1, "Micro-batches per optimizer step (AdamW only).")
    max_steps: int = _opt(-1, "Optimizer steps (overrides num_train_epochs when > 0).")
    num_train_epochs: float = _opt(3.0, "Epochs when max_steps is not set.")
    weight_decay: float = _opt(0.0, "Decoupled weight decay (not applied to biases and norms).")
    adam_beta1: float = _opt(0.9, "AdamW beta1.")
    adam_beta2: float = _opt(0.999, "AdamW beta2.")
    adam_epsilon: float = _opt(1e-8, "AdamW epsilon.")
    max_grad_norm: float = _opt(1.0, "Gradient clipping norm (0 turns it off).")
    lr_scheduler_type: str = _opt("constant", "Learning-rate schedule.", ("constant", "linear", "cosine"))
    warmup_steps: int = _opt(0, "Linear warm-up steps.")
    warmup_ratio: float = _opt(0.0, "Warm-up as a fraction of max_steps (used when warmup_steps is 0).")
    bf16: bool | None = _opt(None, "bf16 autocast (default: on for CUDA devices that support it).")
    fp16: bool = _opt(False, "fp16 autocast with loss scaling (CUDA only).")
    gradient_checkpointing: bool = _opt(False, "Recompute activations in the backward pass to save memory.")
    compile: bool = _opt(False, "torch.compile the model.")
    fused_adamw: bool = _opt(True, "AdamW's fused kernel where all weights sit on one CUDA or CPU device (false: torch's default).")
    tf32: bool = _opt(True, "TF32 matmuls on Ampere or newer GPUs (false: full fp32 matmuls).")
    group_by_length: bool | None = _opt(None, "Batch examples of similar length together (less padding). Default: on for --objective lm; off for contrastive and grit, whose in-batch negatives it would thin out (a passage's questions share its length, so they would share a batch, and a copy of a query's positive is no negative).")
    packing: bool | None = _opt(None, "Padding-free batches: a batch's sequences end to end in one row (causal LMs, loss on the gold continuation; the model must keep packed sequences apart, which is checked). Default: on with flash attention (varlen kernels), off with sdpa/eager, where it pays only for large models (see BENCHMARKS.md).")
    # loop, logging, checkpoints
    output_dir: str = _opt("output", "Where the run writes config.yaml, metrics.jsonl, results.json and checkpoints.")
    overwrite_output_dir: bool = _opt(False, "Start over in an output_dir that holds a run.")
    logging_steps: int = _opt(10, "Log the training loss every N steps.")
    evaluation_strategy: str = _opt("no", "Evaluate on dev every eval_steps (steps) or never (no).", ("no", "steps"),
                                    aliases=("eval_strategy",))
    eval_steps: int = _opt(500, "Evaluate every N steps.")
    eval_on_start: bool = _opt(False, "Also evaluate before the first step (the dev split, else the --eval_file rows; grpo: the held-out pass@1 before training).")
    log_samples: int = _opt(0, "Instruction data: also log N of the dev generations (prompt, prediction, reference) to metrics.jsonl at each evaluation.")
    save_strategy: str = _opt("steps", "Checkpoint every save_steps (steps) or never (no).", ("no", "steps"))
    save_steps: int = _opt(500, "Checkpoint every N steps.")
    save_total_limit: int | None = _opt(None, "Keep at most this many checkpoints.")
    save_only_model: bool = _opt(False, "Checkpoints hold the trainable weights only (no optimizer state; not resumable exactly).")
    load_best_model_at_end: bool = _opt(False, "Reload the best dev checkpoint at the end.")
    resume_from_checkpoint: str | None = _opt(None, "Checkpoint folder, or 'latest'.")
    report_to: str = _opt("none", "Also log to trackers, comma-separated: tensorboard, wandb, mlflow, trackio (through Accelerate's trackers; their files go to output_dir), or none.")
    result_file: str | None = _opt(None, "Also copy results.json here, as MeZO's run.py does; 'auto': MeZO's name, result/{TASK}-{MODEL}-...-trainset{SEED}.json (what `xgblora mezo` writes). Never over an existing file.")
    tag: str = _opt("", "Tag in the MeZO-style result file name.")
    nan_policy: str = _opt("stop", "On a NaN/inf loss: stop (keep the last good checkpoint) or skip the step.", ("stop", "skip"))
    ddp_timeout: int = _opt(1800, "Multi-process runs: seconds a rank waits for the others in a collective before it stops with an error.")
    seed: int = _opt(42, "Seed of everything except the train/dev sampling.")
    no_eval: bool = _opt(False, "Skip the final evaluation.")

    def __post_init__(self) -> None:
        self._resolve_shortcuts()
        self._check_values()
        self._check_combinations()

    def _resolve_shortcuts(self) -> None:
        """Fill what depends on other options: the GGUF file into the model name, MeZO's --num_train for its tasks,
        the method --lora / --xgblora name; check the dev split's sizing."""
        self.resolve_gguf_file()
        if self.num_train is None and not self.own_data:
            object.__setattr__(self, "num_train", MEZO_NUM_TRAIN)
        if self.eval_split_ratio is not None:
            if not self.own_data:
                raise UserError(f"--eval_split_ratio holds out a share of your own --train_file; task "
                                f"{self.task_name} follows MeZO's protocol: pass --num_dev N")
            if self.num_dev is not None:
                raise UserError("--num_dev and --eval_split_ratio both size the dev split; pass one of them")
            if not 0.0 < self.eval_split_ratio < 1.0:
                raise UserError(f"--eval_split_ratio must be in (0, 1), got {self.eval_split_ratio}")
        named = [m for m, flag in (("lora", self.lora), ("xgblora", self.xgblora)) if flag]
        if len(named) > 1 or (named and self.method not in ("ft", named[0])):
            given = [f"--method {self.method}"] * (self.method != "ft") + [f"--{m}" for m in named]
            raise UserError(f"{' and '.join(given)} name different methods; pass one of them")
        if self.xgblora:
            object.__setattr__(self, "method", "xgblora")
        elif self.lora and self.method == "ft":
            object.__setattr__(self, "method", "lora")

    def _check_values(self) -> None:
        """One-line errors for options outside their range or choices, each on its own."""
        if self.evaluation_strategy == "steps" and self.eval_steps <= 0:
            raise UserError(f"--eval_steps must be positive with --evaluation_strategy steps, got {self.eval_steps}")
        if self.save_strategy == "steps" and self.save_steps <= 0:
            raise UserError(f"--save_steps must be positive with --save_strategy steps, got {self.save_steps}")
        check_finite(self)
        check_choices(self)
        _check_positive(self, "ddp_timeout", "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                        "lora_r", "xgblora_steps_per_iteration", "xgblora_num_boosters", "xgblora_adaptive_max_steps",
                        "xgblora_adaptive_patience", "logging_steps", "max_length", "learning_rate",
                        "zo_eps", "head_learning_rate", "head_probe_l2", "contrastive_temperature",
                        "grit_generative_batch_size", "zo_queries", "zo_svrg_period", "zo_svrg_anchor_batches")
        if self.max_length < 2:
            raise UserError(f"--max_length must be at least 2 (a token is scored from the tokens before it), got "
                            f"{self.max_length}")
        for flag in ("num_train", "num_dev", "num_eval"):
            if getattr(self, flag) is not None and getattr(self, flag) < 0:
                raise UserError(f"--{flag} must be 0 or more, got {getattr(self, flag)}")
        if not 0 <= self.train_set_seed < 2**32:
            raise UserError(f"--train_set_seed must be between 0 and 2**32 - 1, got {self.train_set_seed}")
        if self.max_steps == 0 or self.max_steps < -1:
            raise UserError(f"--max_steps must be positive (or -1: train --num_train_epochs epochs), got {self.max_steps}")
        if self.max_steps == -1 and self.num_train_epochs <= 0:
            raise UserError(f"--num_train_epochs must be positive, got {self.num_train_epochs}")
        _check_positive(self, "save_total_limit", "max_new_tokens")
        for name in ("warmup_steps", "weight_decay", "max_grad_norm"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name} must be 0 or more, got {getattr(self, name)}")
        for name in ("lora_dropout", "adam_beta1", "adam_beta2", "xgblora_adaptive_ema", "warmup_ratio"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UserError(f"--{name} must be in [0, 1), got {getattr(self, name)}")
        parse_report_to(self.report_to)

    def _check_combinations(self) -> None:
        """One-line errors (and a warning) for options that do not go together."""
        if self.load_in_4bit and self.method == "ft" and self.trainer != "none":
            raise UserError("--load_in_4bit trains adapters on a frozen 4-bit base; full fine-tuning cannot update "
                            "4-bit weights: use --method lora or --method xgblora")
        if self.adapter and self.method == "ft" and self.trainer != "none":
            raise UserError("--adapter continues training a LoRA adapter: use --method lora or --method xgblora")
        if self.load_float16 and self.load_bfloat16:
            raise UserError("--load_float16 and --load_bfloat16 cannot both be set")
        if self.trainer == "zo" and self.gradient_accumulation_steps != 1:
            raise UserError("--gradient_accumulation_steps does not apply to --trainer zo (MeZO has no gradients to accumulate); "
                            "raise --per_device_train_batch_size instead")
        if self.xgblora_norm_penalty is not None and self.xgblora_norm_penalty < 0:
            raise UserError(f"--xgblora_norm_penalty must be 0 or more, got {self.xgblora_norm_penalty}")
        if self.xgblora_layers_per_booster is not None and self.xgblora_layers_per_booster < 1:
            raise UserError(f"--xgblora_layers_per_booster must be at least 1, got {self.xgblora_layers_per_booster}")
        if self.xgblora_init_batches < 1:
            raise UserError(f"--xgblora_init_batches must be at least 1, got {self.xgblora_init_batches}")
        if self.xgblora_init == "gradient" and self.trainer == "zo" and self.method == "xgblora":
            raise UserError("--xgblora_init gradient needs the gradient of each adapted weight, a backward pass: "
                            "under --trainer zo a few zeroth-order estimates cannot find its leading direction "
                            "(that takes hundreds of forward pairs per layer); use --xgblora_init random")
        if (self.grit_generative_batch_size or 0) > self.per_device_train_batch_size:
            raise UserError(f"--grit_generative_batch_size {self.grit_generative_batch_size} takes the instruction "
                            f"examples of a batch's first pairs: at most --per_device_train_batch_size "
                            f"{self.per_device_train_batch_size}")
        if self.trainer == "zo":
            self._check_zo_estimator()
        self._check_objective()
        if not 0.0 < self.xgblora_shrinkage <= 1.0:
            raise UserError(f"--xgblora_shrinkage must be in (0, 1], got {self.xgblora_shrinkage}")

    def _check_objective(self) -> None:
        """The options tied to the objective: what an embedding run or GRIT needs or cannot use, and which tokens
        the loss covers."""
        if self.learnable_temperature and self.trainer == "zo":
            raise UserError("--learnable_temperature needs --trainer regular (MeZO's dual batch perturbs adapter "
                            "weights only); fix the temperature with --contrastive_temperature instead")
        if self.objective == "grit" and self.trainer != "none" and not self.grit_train_file:
            raise UserError("--objective grit needs --grit_train_file: instruction rows for the generative loss "
                            "(messages, prompt/completion or text)")
        if self.grit_train_file and self.objective != "grit":
            raise UserError(f"--grit_train_file feeds GRIT's generative loss; it has no use with --objective "
                            f"{self.objective} (pass --objective grit)")
        if self.mini_batch_size < 0 or (self.mini_batch_size and self.objective == "lm"):
            raise UserError(f"--mini_batch_size (gradient caching) takes a number of rows with --objective "
                            f"contrastive or grit, got {self.mini_batch_size} with --objective {self.objective}")
        if not self.only_train_option and (self.train_as_classification or self.objective != "lm"
                                           or self.task_name.lower() == "custom"):
            raise UserError("--only_train_option false puts the loss on every token of a MeZO task's prompt and "
                            "gold candidate; it has no meaning with --train_as_classification, an embedding "
                            "objective or custom data (instruction data: --train_on_prompt)")

    def _check_zo_estimator(self) -> None:
        """Refuse the ZO flags an estimator cannot use, with the reason."""
        if self.zo_svrg_anchor_learning_rate is not None and (self.zo_estimator != "svrg"
                                                               or not self.zo_svrg_anchor_learning_rate > 0):
            raise UserError(f"--zo_svrg_anchor_learning_rate {self.zo_svrg_anchor_learning_rate}: a positive rate, "
                            f"for --zo_estimator svrg only")
        if self.zo_queries is not None and self.zo_estimator in ("mezo", "svrg") and self.zo_queries != 1:
            raise UserError(f"--zo_queries {self.zo_queries}: --zo_estimator {self.zo_estimator} takes one "
                            f"perturbation per step; use --zo_estimator nspsa (n two-point estimates) or fzoo")
        if self.zo_estimator == "fzoo" and self.zo_queries is not None and self.zo_queries < 2:
            raise UserError(f"--zo_queries {self.zo_queries}: fzoo divides by the spread of its perturbed losses "
                            f"and needs at least 2")
        if self.zo_estimator == "fzoo" and self.zo_dual:
            raise UserError("--zo_dual: fzoo perturbs one-sided with --zo_queries different vectors, which the "
                            "doubled batch (+z and -z of one vector) cannot carry; drop --zo_dual")
        if self.zo_optimizer != "sgd" and self.method == "ft" and self.dtype_name != "float32":
            raise UserError(f"--zo_optimizer {self.zo_optimizer} keeps its state in the weights' dtype, where "
                            f"{self.dtype_name} loses the small updates of full fine-tuning: load fp32 weights or "
                            f"use --zo_optimizer sgd")

    @property
    def groups_by_length(self) -> bool:
        """Whether training batches group examples of similar length: --group_by_length, else only for --objective
        lm."""
        return self.objective == "lm" if self.group_by_length is None else self.group_by_length

    @property
    def methods_used(self) -> set[str]:
        """The methods the command trains (compare: one per --methods entry)."""
        return {self.method}

    @property
    def trainers_used(self) -> set[str]:
        """The trainers the command runs (compare: one per --methods entry)."""
        return {self.trainer}

    @property
    def similarity_temperature(self) -> float:
        """--contrastive_temperature, else 0.02 for grit (GritLM's arguments.py) and 0.05 for contrastive."""
        if self.contrastive_temperature is not None:
            return self.contrastive_temperature
        return 0.02 if self.objective == "grit" else 0.05

    @property
    def pools_prompt(self) -> bool:
        """--include_prompt, else off for grit (GritLM masks the instruction out of the pooling) and on otherwise."""
        return self.include_prompt if self.include_prompt is not None else self.objective != "grit"

    @property
    def data(self) -> DataOptions:
        """The data options, as data/ receives them."""
        names = [f.name for f in dataclasses.fields(DataOptions) if f.name != "evaluation_only"]
        return DataOptions(**{name: getattr(self, name) for name in names}, evaluation_only=self.trainer == "none")

    @property
    def own_data(self) -> bool:
        """Whether the rows are the user's own (--task_name custom, or pairs for an embedding objective) rather than
        one of MeZO's tasks: their defaults are every row for training and no dev split."""
        return self.task_name.lower() == "custom" or self.objective != "lm"

    @property
    def rank(self) -> int:
        """Adapter rank: --lora_r, else 1 for XGBLoRA boosters and 8 for LoRA."""
        if self.lora_r is not None:
            return self.lora_r
        return 1 if self.method == "xgblora" else 8

    @property
    def norm_penalty(self) -> float:
        """XGBLoRA's lambda: --xgblora_norm_penalty, else the preset's (paper 1e-3, plain 0); 0 for other methods."""
        if self.method != "xgblora":
            return 0.0
        if self.xgblora_norm_penalty is not None:
            return self.xgblora_norm_penalty
        return PAPER_NORM_PENALTY if self.xgblora_preset == "paper" else 0.0

    @property
    def layer_share(self) -> float:
        """The share of layers a booster is drawn on when --xgblora_layers_per_booster is unset."""
        return 1 / 3 if self.xgblora_preset == "paper" else 1.0

    def booster_steps(self, max_steps: int) -> int:
        """Steps per booster: --xgblora_steps_per_iteration, else max_steps / --xgblora_num_boosters (default: the
        preset's count)."""
        if self.xgblora_steps_per_iteration is not None:
            return self.xgblora_steps_per_iteration
        return max(1, max_steps // (self.xgblora_num_boosters or PRESET_BOOSTERS[self.xgblora_preset]))

    @property
    def alpha(self) -> float:
        """--lora_alpha, else 2r (alpha/r = 2 at every rank, as MeZO's r=8, alpha=16), else under rsLoRA 2 sqrt(8)."""
        if self.lora_alpha is not None:
            return self.lora_alpha
        return 2 * math.sqrt(8) if self.use_rslora else 2.0 * self.rank



@dataclass(frozen=True)
class CompareConfig(Config):
    """Options of `xgblora compare`: the train options plus the methods, seeds and where the report goes."""

    trainer: str = _opt("zo", "Trainer of the methods given without one (METHOD:TRAINER names its own).", ("regular", "zo"))
    output_root: str = _opt("compare", "Folder holding one sub-folder per run and the report.")
    loss_figure_path: str | None = _opt(None, "Where to write the loss figure (default <output_root>/loss.png).")
    seeds: list[int] = _opt([0], "Seeds to run each method with.")
    methods: list[str] = _opt(["xgblora", "lora"], "Methods to compare: ft, lora, xgblora, optionally as method:trainer (e.g. lora:regular), the trainer also a ZO estimator (lora:fzoo, lora:svrg, lora:nspsa, lora:mezo).")
    overwrite: bool = _opt(False, "Redo runs that already finished.")

    @property
    def methods_used(self) -> set[str]:
        return {spec.partition(":")[0] for spec in self.methods}

    @property
    def trainers_used(self) -> set[str]:
        named = {spec.partition(":")[2] or self.trainer for spec in self.methods}
        return {"zo" if trainer in ZO_ESTIMATORS else trainer for trainer in named}


@dataclass(frozen=True)
class SamplingOptions:
    """How completions are drawn: `xgblora generate`'s and RFT's sampler (see sampling.py)."""

    num_return_sequences: int = _opt(1, "Completions per prompt (each prompt runs once; its KV cache is shared by them).",
                                     aliases=("num_samples",))
    temperature: float = _opt(0.0, "Sampling temperature; 0 is greedy.")
    top_p: float = _opt(1.0, "Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p.")
    max_batch_tokens: int = _opt(32768, "Memory budget of a generation batch: rows x (longest prompt + max_new_tokens) tokens of KV cache.")

    def check_sampling(self) -> None:
        """One-line errors for sampling options out of range."""
        _check_positive(self, "num_return_sequences", "max_batch_tokens")
        if self.temperature < 0:
            raise UserError(f"--temperature must be 0 (greedy) or more, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"--top_p must be in (0, 1], got {self.top_p}")
        if self.num_return_sequences > 1 and self.temperature == 0:
            raise UserError(f"--num_return_sequences {self.num_return_sequences} with --temperature 0 would return "
                            f"the same greedy completion {self.num_return_sequences} times; set a temperature")


@dataclass(frozen=True)
class ChatConfig(SamplingOptions, ModelOptions):
    """Options of `xgblora chat`: a model, how it samples, and the conversation's template."""

    model_name: str = _opt("tiny-llama-chat", "A base model (hub id, folder, pkg:, built-in), a merged model, a PEFT adapter folder, or an xgblora run directory.")
    chat_template: str | None = _opt(None, "A Jinja chat template file, replacing the tokenizer's.")
    system_prompt: str | None = _opt(None, "A system turn before the conversation.")
    max_new_tokens: int = _opt(256, "Most tokens per completion.")
    max_length: int = _opt(4096, "Longest prompt in tokens; longer ones are cut from the left.")
    seed: int = _opt(0, "Seed of the sampling (the same seed gives the same completions, also after a resume).")

    def __post_init__(self) -> None:
        self.resolve_gguf_file()
        check_finite(self)
        check_choices(self)
        self.check_sampling()
        _check_positive(self, "max_new_tokens", "max_length")


@dataclass(frozen=True)
class GenerateConfig(ChatConfig):
    """Options of `xgblora generate`: the chat options plus the prompts file and where the completions go."""

    input_file: str | None = _opt(None, "Prompts: rows with a prompt (a string or a list of messages) or messages, in any form --train_file takes.")
    output_file: str = _opt("generations.jsonl", "Where the completions go (JSONL: each input row with its completions); an interrupted run continues from its .partial file.")
    columns: str | None = _opt(None, "Map your column names to ours, OURS=THEIRS (e.g. prompt=question).")
    raw_prompts: bool = _opt(False, "Send string prompts as they are, even when the tokenizer has a chat template (by default a string prompt becomes a user turn).")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.input_file:
            raise UserError("xgblora generate needs --input_file (a JSONL, CSV, parquet... file of prompts)")


@dataclass(frozen=True)
class RFTConfig(Config, SamplingOptions):
    """Options of `xgblora rft`: the train options (the method and trainer of every round) plus sampling and
    verification. --train_file holds the questions with their reference answers, --eval_file the held-out ones."""

    rounds: int = _opt(1, "Rounds of sample -> verify -> train -> evaluate; each samples from and trains on the last round's model.")
    sampler_model: str | None = _opt(None, "A model (e.g. a larger one) that samples every round, instead of the model being trained.")
    keep_per_prompt: int | None = _opt(None, "Most correct, distinct completions kept per question (default: all, as RFT's reference keeps them).")
    distinct: str = _opt("equations", "Which correct completions count as the same: equations (the same list of <<a*b=c>> calculator annotations, the most different one kept: RFT's reference; completions without annotations by their text) or text.",
                         ("equations", "text"))
    check_equations: bool = _opt(True, "Reject a correct completion whose calculator annotations <<lhs=rhs>> do not hold (lhs evaluated, within 1e-3 of rhs), as RFT's reference does.")
    include_gold: bool = _opt(False, "Also train on each question's reference solution (RFT trains on the SFT data plus the samples; off here as --model_name has usually been fine-tuned on it already).")
    restart_from_base: bool = _opt(False, "Each round fine-tunes the starting model (--model_name with its --adapter) on that round's samples (STaR, ReST-EM), instead of continuing from the last round's model; samples still come from the last round's model.")
    rationalize: bool = _opt(False, "STaR's rationalisation: questions with no correct sample are sampled again with the reference answer as a hint; correct hinted completions are trained on under the original question.")
    verifier: str = _opt("gsm8k", "How an answer is read: gsm8k (the first number after the first ####), math (math-verify: LaTeX, \\boxed{}, equivalent forms; pip install math-verify), answer_tags (<answer>...</answer>), regex:PATTERN, or module:function.")
    answer_tolerance: float = _opt(1e-6, "Numbers agree within this relative tolerance.")
    pass_k: int = _opt(8, "Held-out evaluation: pass@k at --temperature (besides greedy pass@1); 0 for pass@1 only.")
    pass_n: int | None = _opt(None, "Held-out evaluation: samples drawn per question for pass@k, n >= k (the unbiased estimator 1 - C(n-c, k) / C(n, k) of Chen et al. 2021; default k).")
    raw_prompts: bool = _opt(False, "Send string prompts as they are, even when the tokenizer has a chat template.")
    output_root: str = _opt("rft", "Folder holding one sub-folder per round and the report.")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_sampling()
        _check_positive(self, "rounds", "keep_per_prompt", "max_new_tokens", "pass_n")
        if self.pass_k < 0:
            raise UserError(f"--pass_k must be 0 or more, got {self.pass_k}")
        if self.pass_n is not None and self.pass_n < self.pass_k:
            raise UserError(f"--pass_n {self.pass_n} must be at least --pass_k {self.pass_k}")
        if not self.train_file or not self.eval_file:
            raise UserError("xgblora rft needs --train_file (questions with reference answers to sample on) and "
                            "--eval_file (held-out questions to measure on)")


@dataclass(frozen=True)
class GRPOConfig(Config, SamplingOptions):
    """Options of `xgblora grpo`: the train options (method, trainer, optimiser, checkpoints) plus GRPO's, under TRL's
    GRPOConfig names where TRL has them. --train_file holds the prompts, --eval_file the held-out ones (pass@1)."""

    num_return_sequences: int = _opt(8, "Completions per prompt, G (TRL's num_generations): each prompt runs once and its KV cache is shared by them.",
                                     aliases=("num_generations", "num_samples"))
    max_new_tokens: int = _opt(256, "Most tokens per completion (TRL's max_completion_length; dr_grpo's normaliser).",
                               aliases=("max_completion_length",))
    temperature: float = _opt(1.0, "Sampling temperature (the log-probabilities of the loss are taken at it too, as TRL does).")
    reward_funcs: list[str] = _opt(["gsm8k"], "Reward functions: gsm8k, math, answer_tags, regex:PATTERN (1 when the answer agrees with the row's reference, else 0), format:<one of those> (1 when an answer is found at all), or module:function (TRL's signature: f(prompts, completions, completion_ids, **columns) -> list of floats; also given trainer_state, log_extra, log_metric).")
    reward_weights: list[float] | None = _opt(None, "Weight of each reward function in the total reward (default: 1 each).")
    multi_objective_aggregation: str = _opt("sum_then_normalize", "Several reward functions: weigh and sum them, then form advantages (sum_then_normalize), or normalise each within its group first, then weigh, sum and normalise over the batch (normalize_then_sum: GDPO), as TRL.",
                                            ("sum_then_normalize", "normalize_then_sum"))
    answer_tolerance: float = _opt(1e-6, "Correctness rewards: numbers agree within this relative tolerance.")
    beta: float = _opt(0.0, "KL coefficient to the reference policy (TRL's default 0: no reference pass). The reference is the model as it started: a new adapter switched off, an --adapter continued from kept frozen; under --method ft a frozen copy.")
    epsilon: float = _opt(0.2, "Clipping: the ratio is kept within [1 - epsilon, 1 + epsilon_high].")
    epsilon_high: float | None = _opt(None, "Upper clipping epsilon (default: epsilon; DAPO uses 0.28).")
    loss_type: str = _opt("dapo", "How token losses add up: grpo (each completion's mean, then the mean), bnpo (each micro-batch's token mean), dr_grpo (sum over max_completion_length per completion), dapo (the mean over the generation batch's tokens: TRL's default), cispo (dapo's mean of the ratio-clipped policy gradient, MiniMax-M1; clips at --epsilon_high, about 5).",
                          ("grpo", "bnpo", "dr_grpo", "dapo", "cispo"))
    importance_sampling_level: str = _opt("token", "Importance ratios per token, or one per completion from its tokens' mean log-ratio (sequence: GSPO).",
                                          ("token", "sequence"))
    scale_rewards: str = _opt("group", "Advantages are rewards minus their group's mean, divided by the std of the group, of the batch, or not at all (none; Dr. GRPO).",
                              ("group", "batch", "none"))
    use_bias_correction_kl: bool = _opt(True, "Multiply the KL term by the importance ratio (TRL's default; the unbiased reverse-KL gradient).")
    mask_truncated_completions: bool = _opt(False, "Leave completions cut at max_completion_length out of the loss.")
    num_iterations: int = _opt(1, "Optimizer passes over each generation batch (mu).")
    generation_batch_size: int | None = _opt(None, "Completions sampled at a time, over all processes (a multiple of the optimizer batch, per_device_train_batch_size x gradient_accumulation_steps x processes, and of G; default: one optimizer batch).")
    steps_per_generation: int | None = _opt(None, "Micro-batches per process per generation batch (TRL's; the other way to set generation_batch_size).")
    log_completions: bool = _opt(False, "Log a few completions, with their rewards, to metrics.jsonl at every logging step.")
    eval_on_start: bool = _opt(True, "Evaluate the held-out prompts (--eval_file) before the first step too: results.json's before_ figures.")
    raw_prompts: bool = _opt(True, "Send string prompts as they are, as TRL does (conversational rows always get the chat template); false renders each string as a user turn of the chat template.")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_sampling()
        _check_positive(self, "max_new_tokens", "num_iterations", "generation_batch_size", "steps_per_generation")
        if self.temperature == 0:
            raise UserError("--temperature 0 samples one greedy completion G times: GRPO needs a temperature above 0")
        if self.num_return_sequences < 2:
            raise UserError(f"--num_generations {self.num_return_sequences}: GRPO's advantages compare the completions "
                            f"of a prompt, so it needs at least 2 (as TRL)")
        if not self.train_file:
            raise UserError("xgblora grpo needs --train_file (prompts, with reference answers for correctness rewards)")
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise UserError("give --generation_batch_size or --steps_per_generation, not both")
        if self.generation_batch() % self.optimizer_batch:
            raise UserError(f"--generation_batch_size {self.generation_batch()} must be a multiple of the optimizer "
                            f"batch, per_device_train_batch_size x gradient_accumulation_steps = {self.optimizer_batch}")
        if self.generation_batch() % self.num_return_sequences:
            raise UserError(f"the generation batch of {self.generation_batch()} completions must be a multiple of "
                            f"--num_generations {self.num_return_sequences}")
        if self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise UserError("--epsilon and --epsilon_high must be 0 or more")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise UserError(f"--reward_weights has {len(self.reward_weights)} values for {len(self.reward_funcs)} "
                            f"--reward_funcs")

    @property
    def optimizer_batch(self) -> int:
        """Completions per optimizer step."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    def generation_batch(self, processes: int = 1) -> int:
        """Completions sampled at a time over all processes: --generation_batch_size, else --steps_per_generation
        micro-batches per process, else one optimizer batch per process."""
        if self.generation_batch_size is not None:
            return self.generation_batch_size
        if self.steps_per_generation is not None:
            return self.steps_per_generation * self.per_device_train_batch_size * processes
        return self.optimizer_batch * processes



DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo", "sft")


@dataclass(frozen=True)
class DPOConfig(Config):
    """Options of `xgblora dpo`: the train options (method, trainer, optimiser, checkpoints) plus preference
    training's, under TRL's DPOConfig names (CPOConfig's simpo_gamma). --train_file holds the pairs, --eval_file
    held-out ones (reward accuracy)."""

    loss_type: list[str] = _opt(["sigmoid"], "Preference losses (TRL's): sigmoid (DPO), ipo, hinge, robust (with label_smoothing), simpo and orpo (no reference model), sft (the chosen completions' NLL); several add up with --loss_weights.")
    loss_weights: list[float] | None = _opt(None, "Weight of each --loss_type (default: 1 each).")
    beta: float = _opt(0.1, "Temperature of the implicit reward beta (IPO's tau; SimPO's and ORPO's beta).")
    label_smoothing: float = _opt(0.0, "Probability that a pair's preference is flipped (robust, simpo), in [0, 0.5).")
    simpo_gamma: float = _opt(0.5, "SimPO's target reward margin gamma (TRL's CPOConfig).")
    reference_free: bool = _opt(False, "Take the reference's log-probabilities as 0 (no reference forward).")
    rpo_alpha: float | None = _opt(None, "RPO: add the chosen completions' NLL with this weight (TRL's loss_type sft beside sigmoid).")
    max_prompt_length: int | None = _opt(None, "Keep each prompt's last N tokens (before --max_length cuts prompt + completion at the end).")
    precompute_ref_log_probs: bool = _opt(False, "Compute the reference's log-probabilities of every pair once before training (always so for XGBLoRA, full fine-tuning and a continued --adapter).")
    precompute_ref_batch_size: int | None = _opt(None, "Pairs per forward while precomputing (default: per_device_eval_batch_size).")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.train_file:
            raise UserError("xgblora dpo needs --train_file (preference pairs: prompt, chosen, rejected)")
        unknown = [t for t in self.loss_type if t not in DPO_LOSS_TYPES]
        if unknown or not self.loss_type:
            raise UserError(f"--loss_type {' '.join(unknown)}: choose from {', '.join(DPO_LOSS_TYPES)}")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise UserError(f"--loss_weights has {len(self.loss_weights)} values for {len(self.loss_type)} --loss_type")
        if self.beta <= 0:
            raise UserError(f"--beta must be positive, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise UserError(f"--label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.rpo_alpha is not None and "sft" in self.loss_type:
            raise UserError("--rpo_alpha adds the sft loss type; give it or --loss_type sft, not both")
        _check_positive(self, "max_prompt_length", "precompute_ref_batch_size")

    @property
    def loss_terms(self) -> tuple[tuple[str, ...], tuple[float, ...]]:
        """The loss types and their weights, RPO's sft term included."""
        weights = tuple(self.loss_weights or [1.0] * len(self.loss_type))
        if self.rpo_alpha is None:
            return tuple(self.loss_type), weights
        return (*self.loss_type, "sft"), (*weights, self.rpo_alpha)

# ----------------------------------------------------------------------------- options a run would ignore

ADAPTER_OPTIONS = ("lora_r", "lora_alpha", "use_rslora", "lora_dropout", "lora_target_modules")
XGBLORA_ADAPTIVE_OPTIONS = ("xgblora_adaptive_max_steps", "xgblora_adaptive_patience", "xgblora_adaptive_threshold",
                            "xgblora_adaptive_ema")
XGBLORA_OPTIONS = ("xgblora_preset", "xgblora_num_boosters", "xgblora_steps_per_iteration",
                   "xgblora_layers_per_booster", "xgblora_shrinkage", "xgblora_norm_penalty",
                   "xgblora_restart_schedule", "xgblora_init", "xgblora_init_batches", "xgblora_adaptive",
                   *XGBLORA_ADAPTIVE_OPTIONS)
ZO_OPTIONS = ("zo_eps", "zo_dual", "zo_estimator", "zo_queries", "zo_optimizer", "zo_svrg_period",
              "zo_svrg_anchor_batches", "zo_stochastic_rounding", "head_trainer", "head_learning_rate")
GRIT_OPTIONS = ("grit_contrastive_weight", "grit_generative_weight", "grit_generative_batch_size")
EMBEDDING_OPTIONS = ("query_instruction", "doc_instruction", "instruction_format", "include_prompt",
                     "contrastive_temperature", "contrastive_loss", "learnable_temperature", "bidirectional",
                     *GRIT_OPTIONS)
CLASSIFICATION_OPTIONS = ("template", "label_words", "label_names", "sfc", "icl_sfc", "train_as_classification")
TRAINING_OPTIONS = ("lora", "xgblora", "method", *ADAPTER_OPTIONS, *XGBLORA_OPTIONS, *ZO_OPTIONS, "learning_rate",
                    "lr_scheduler_type", "warmup_steps", "warmup_ratio", "max_steps", "num_train_epochs",
                    "per_device_train_batch_size", "gradient_accumulation_steps", "weight_decay", "adam_beta1",
                    "adam_beta2", "adam_epsilon", "max_grad_norm", "fused_adamw", "gradient_checkpointing", "compile",
                    "group_by_length", "packing", "loss_mean", "only_train_option", "train_as_classification",
                    "head_init", "head_probe_l2", "contrastive_loss", "learnable_temperature", "mini_batch_size",
                    "embed_pieces", *GRIT_OPTIONS, "logging_steps", "evaluation_strategy", "eval_steps", "eval_on_start",
                    "log_samples", "save_strategy", "save_steps", "save_total_limit", "save_only_model",
                    "load_best_model_at_end", "resume_from_checkpoint", "report_to", "nan_policy", "no_eval")
# What `xgblora rft` and `xgblora grpo` never read: they train on instruction rows of their own (RFT's kept samples,
# GRPO's prompts) with the language-modelling loss, so MeZO's tasks, classification heads and embeddings have no
# place; RFT sets each round's data, evaluation and folder itself. Their parsers leave these flags out.
SAMPLE_TRAINING_IGNORES = ("task_name", "data_dir", "num_train", "num_dev", "num_eval", "train_set_seed", "dev_pool",
                           "data_format", "result_file", "tag", "no_eval", *CLASSIFICATION_OPTIONS,
                           "only_train_option", "head", "pooling", "head_init", "head_probe_l2", "objective",
                           "mini_batch_size", "embed_pieces", "grit_train_file", *EMBEDDING_OPTIONS)
RFT_IGNORES = (*SAMPLE_TRAINING_IGNORES, "output_dir", "eval_on_start")
GRPO_IGNORES = (*SAMPLE_TRAINING_IGNORES, "eval_split_ratio", "loss_mean", "train_on_prompt", "log_samples",
                "per_device_eval_batch_size", "packing", "group_by_length", "compile",
                "gradient_checkpointing", "tf32")
# `xgblora dpo` trains on preference pairs: no generation, packing or prompt loss; its forwards carry a KV cache
# from each prompt to its two completions, which gradient checkpointing would switch off.
DPO_IGNORES = (*SAMPLE_TRAINING_IGNORES, "eval_split_ratio", "loss_mean", "train_on_prompt", "log_samples", "packing",
               "gradient_checkpointing", "tf32", "max_new_tokens", "head_trainer", "head_learning_rate")


@dataclass(frozen=True)
class Ignored:
    """Options a run never reads while `applies(cfg)` holds: refused, once changed from their default, with
    `reason` (why they do nothing there, and what to pass instead)."""

    options: tuple[str, ...]
    applies: typing.Callable[[Any], bool]
    reason: str


def _training(cfg: Any) -> bool:
    return isinstance(cfg, Config)


IGNORED = (
    Ignored(TRAINING_OPTIONS, lambda c: _training(c) and c.trainers_used == {"none"},
            "nothing trains under --trainer none (what xgblora eval and xgblora mezo run by default); drop it, or "
            "train with xgblora train"),
    Ignored(ZO_OPTIONS, lambda c: _training(c) and "zo" not in c.trainers_used,
            "a zeroth-order option, unused by --trainer regular (AdamW); pass --trainer zo"),
    Ignored(("max_grad_norm", "fused_adamw", "gradient_checkpointing"),
            lambda c: _training(c) and c.trainers_used == {"zo"},
            "an AdamW/back-propagation option; --trainer zo runs forward passes only"),
    Ignored(("adam_beta1",), lambda c: _training(c) and c.trainers_used == {"zo"} and c.zo_optimizer == "sgd",
            "--trainer zo with --zo_optimizer sgd keeps no momentum; pass --zo_optimizer momentum or adam"),
    Ignored(("adam_beta2", "adam_epsilon"),
            lambda c: _training(c) and c.trainers_used == {"zo"} and c.zo_optimizer != "adam",
            "--trainer zo reads it with --zo_optimizer adam only"),
    Ignored((*ADAPTER_OPTIONS, *XGBLORA_OPTIONS), lambda c: _training(c) and c.methods_used == {"ft"},
            "full fine-tuning (--method ft) trains no adapter; pass --method lora or --method xgblora"),
    Ignored(XGBLORA_OPTIONS, lambda c: _training(c) and "xgblora" not in c.methods_used,
            "an XGBLoRA booster option, unused by plain LoRA; pass --method xgblora"),
    Ignored(XGBLORA_ADAPTIVE_OPTIONS, lambda c: _training(c) and not c.xgblora_adaptive,
            "the adaptive merge's option; pass --xgblora_adaptive"),
    Ignored(EMBEDDING_OPTIONS, lambda c: _training(c) and c.objective == "lm",
            "an embedding option, unused by --objective lm; pass --objective contrastive or grit"),
    Ignored(GRIT_OPTIONS, lambda c: _training(c) and c.objective == "contrastive",
            "a GRIT option, unused by --objective contrastive; pass --objective grit"),
    Ignored(CLASSIFICATION_OPTIONS, lambda c: _training(c) and c.objective != "lm",
            "a MeZO-task/classification option; an embedding objective trains on pairs"),
    Ignored(("seed", "output_dir", "result_file", "overwrite_output_dir"), lambda c: isinstance(c, CompareConfig),
            "xgblora compare sets it for each run; use --seeds, --output_root and --overwrite"),
    Ignored(RFT_IGNORES, lambda c: isinstance(c, RFTConfig),
            "xgblora rft trains each round on its kept samples as instruction data, under --output_root"),
    Ignored(GRPO_IGNORES, lambda c: isinstance(c, GRPOConfig),
            "xgblora grpo trains a language model on its own prompts and never reads it"),
    Ignored(DPO_IGNORES, lambda c: isinstance(c, DPOConfig),
            "xgblora dpo trains a language model on preference pairs and never reads it"),
    Ignored(("num_return_sequences",), lambda c: type(c) is ChatConfig,
            "xgblora chat streams one reply a turn; sample several with xgblora generate"),
)


def check_ignored(cfg: Any, defaults: dict[str, Any] | None = None) -> None:
    """Refuse, in one line, an option changed from its default (the command's `defaults`, else the dataclass's) that
    the run would never read."""
    default_of = {f.name: (defaults or {}).get(f.name, _default(f)) for f in dataclasses.fields(cfg)}
    for rule in IGNORED:
        if not rule.applies(cfg):
            continue
        for name in rule.options:
            value = getattr(cfg, name)
            if value != default_of[name]:
                raise UserError(f"--{name} {value!r} does nothing here: {rule.reason}")


def check_finite(cfg: Any) -> None:
    """One-line errors for numbers that are nan or infinite: no option has a meaning for them, and a comparison with
    nan is always false, so a range check alone lets it through."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, float) and not math.isfinite(item):
                raise UserError(f"--{f.name} must be a finite number, got {item}")


def check_choices(cfg: Any) -> None:
    """One-line errors for options outside their choices, for any options dataclass."""
    for f in dataclasses.fields(cfg):
        choices = f.metadata.get("choices")
        if choices and getattr(cfg, f.name) not in choices:
            raise UserError(f"--{f.name} {getattr(cfg, f.name)!r}: choose one of {', '.join(choices)}")


def _check_positive(cfg: Any, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise UserError(f"--{name} must be positive, got {value}")


# ----------------------------------------------------------------------------- parsing

def parse_bool(text: str | bool) -> bool:
    """Parse a boolean flag value the way HF's argument parser does (true/false, yes/no, 1/0)."""
    if isinstance(text, bool):
        return text
    lowered = str(text).strip().lower()
    if lowered in ("true", "yes", "y", "1", "on"):
        return True
    if lowered in ("false", "no", "n", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _field_type(cls: type, f: dataclasses.Field) -> tuple[type, bool, bool]:
    """(base type, optional, is_list) of a dataclass field."""
    hint = typing.get_type_hints(cls)[f.name]
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = True, args[0]
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], optional, True
    return hint, optional, False


def _converter(base: type, optional: bool):
    convert = parse_bool if base is bool else base

    def parse(text: str):
        if optional and isinstance(text, str) and text.strip().lower() in ("none", "null"):
            return None
        return convert(text)

    parse.__name__ = base.__name__  # argparse names the type in its error messages
    return parse


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _aliases(cls: type, f: dataclasses.Field) -> tuple[str, ...]:
    """A field's other names, less those that are a field of the class themselves (`xgblora rft --temperature` is
    the sampling temperature; in `xgblora train` it names --contrastive_temperature)."""
    names = {other.name for other in dataclasses.fields(cls)}
    return tuple(a for a in f.metadata.get("aliases", ()) if a not in names)


def add_arguments(parser: argparse.ArgumentParser, cls: type, defaults: dict[str, Any] | None = None,
                  hidden: tuple[str, ...] = ()) -> None:
    """Add one flag per dataclass field but the `hidden` ones (fields the command never reads), in underscore and
    hyphen spelling plus aliases; defaults are suppressed (the help shows the command's own: `defaults` first, then
    the dataclass's)."""
    for f in dataclasses.fields(cls):
        if f.name in hidden:
            continue
        base, optional, is_list = _field_type(cls, f)
        names = {f"--{f.name}", f"--{f.name.replace('_', '-')}"}
        for alias in _aliases(cls, f):
            names |= {f"--{alias}", f"--{alias.replace('_', '-')}"}
        default = (defaults or {}).get(f.name, _default(f))
        text = f.metadata.get("help", "")
        if default is not None or "default" not in text.lower():  # else the help says what unset means
            text += f" (default: {'unset' if default is None else default})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": text}
        if base is bool:
            kwargs.update(nargs="?", const=True, type=_converter(bool, optional), metavar="BOOL")
        elif is_list:
            kwargs.update(nargs="+", type=base)
        else:
            kwargs.update(type=_converter(base, optional))
            if f.metadata.get("choices"):
                kwargs["choices"] = f.metadata["choices"]
        parser.add_argument(*sorted(names, key=lambda n: ("-" in n[2:], n)), **kwargs)
    parser.add_argument("--config", dest="config", default=argparse.SUPPRESS, metavar="FILE.yaml",
                        help="Read options from a YAML file; flags on the command line win.")


def _check_yaml_value(cls: type, f: dataclasses.Field, value: Any, path: str) -> Any:
    base, optional, is_list = _field_type(cls, f)
    where = f"{path}: key {f.name!r}"
    if value is None:
        if optional:
            return None
        raise UserError(f"{where}: expected {base.__name__}, got null")
    items = value if isinstance(value, list) and is_list else [value]
    accepted = {bool: (bool,), float: (int, float), int: (int,), str: (str,)}[base]
    out = []
    for item in items:
        if not isinstance(item, accepted) or (isinstance(item, bool) and base is not bool):  # YAML true is no int
            raise UserError(f"{where}: expected {base.__name__}, got {type(item).__name__} {item!r}")
        choices = f.metadata.get("choices")
        if choices and item not in choices:
            raise UserError(f"{where}: {item!r} is not one of {', '.join(choices)}")
        out.append(float(item) if base is float else item)
    return out if is_list else out[0]


def read_yaml(cls: type, path: str) -> dict[str, Any]:
    """Read a YAML config into validated field values; unknown keys get the closest valid key suggested."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read config file ({exc.__class__.__name__}: {exc})") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise UserError(f"{path}{line}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of option: value, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    aliases = {a: f.name for f in fields.values() for a in _aliases(cls, f)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = aliases.get(str(key).replace("-", "_"), str(key).replace("-", "_"))
        if name not in fields:
            close = difflib.get_close_matches(name, list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UserError(f"{path}: unknown key {key!r}{hint}")
        values[name] = _check_yaml_value(cls, fields[name], value, path)
    return {k: _beside(Path(path).parent, v) if k in INPUT_PATHS and isinstance(v, str) else v
            for k, v in values.items()}


# Options naming files or folders a run reads: in a YAML config they are relative to the config's own folder
# (outputs stay relative to where the command runs).
INPUT_PATHS = ("train_file", "eval_file", "grit_train_file", "chat_template", "data_dir", "input_file", "adapter",
               "model_name", "sampler_model", "resume_from_checkpoint")


def _beside(folder: Path, value: str) -> str:
    """A relative path in a YAML config, read from the config's folder: when it exists there or is written as a
    path (./x, ../x); anything else (a hub id, a built-in model, 'latest') is left as it is."""
    if Path(value).is_absolute() or value.startswith(("~", "pkg:")):
        return value
    candidate = folder / value
    return str(candidate) if candidate.exists() or value.startswith(("./", "../")) else value


def from_namespace(cls: type, ns: argparse.Namespace, defaults: dict[str, Any] | None = None) -> Config:
    """Build a config from parsed flags: defaults (the command's own first), then --config FILE, then the command line."""
    given = {k: v for k, v in vars(ns).items() if k in {f.name for f in dataclasses.fields(cls)}}
    values = dict(defaults or {})
    values.update(read_yaml(cls, ns.config) if getattr(ns, "config", None) else {})
    values.update(given)
    cfg = cls(**values)
    check_ignored(cfg, defaults)
    return cfg


def dump(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML (every option, so the run can be repeated with --config)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False), encoding="utf-8")
