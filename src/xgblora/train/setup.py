"""Everything a run needs before its first step: task and splits, model and head, what trains, the training set,
and the packing and autocast policies. The config is resolved here once (max_length capped to the model's
positions, the device, model-only checkpoints under FSDP); nothing changes it after. `write_config` puts it in
config.yaml once every check has passed, so that a refused run leaves no output behind."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from xgblora import parsing, perf
from xgblora.adapters import trained
from xgblora.adapters.boosting import Boosting
from xgblora.adapters.lora import (
    LoRALinear,
    adapter_params,
    attach,
    check_adapted,
    exact_targets,
    prepare_full_ft,
)
from xgblora.adapters.peft import read_adapter
from xgblora.config import Config, TrainerConfig, TrainingOptions
from xgblora.data import formats
from xgblora.data.collation import pad_multiple
from xgblora.data.labels import LabelScoring, label_words
from xgblora.data.pairs import PairTask, Prefixes, embedding_prefixes, held_apart, pair_seqs, prefix_length
from xgblora.data.rerank import RerankTask, check_rows
from xgblora.data.splits import Splits, load_rows, sample_splits
from xgblora.data.tasks import CustomTask, Example, Task, get_task
from xgblora.distributed import Distributed
from xgblora.embeddings.contrastive import Contrastive
from xgblora.embeddings.pieces import split_cost
from xgblora.embeddings.pooling import bidirectional_supported
from xgblora.embeddings.rerank import Reranker
from xgblora.errors import UserError
from xgblora.evaluation import labels
from xgblora.evaluation.evaluators import (
    Candidates,
    EvalSizes,
    Evaluator,
    Instructions,
    Labels,
    Reranking,
    Retrieval,
)
from xgblora.models import pretrained
from xgblora.models.quant import is_quantized
from xgblora.models.scoring import is_head_param, packing_supported
from xgblora.train.head import fit_probe
from xgblora.train.objective import (
    PairLoss,
    TrainingLoss,
    TrainingSet,
    causal_training_set,
    grit_training_set,
    label_training_set,
    pair_training_set,
    rerank_training_set,
    sequence_training_set,
)

log = logging.getLogger("xgblora")


@dataclass
class Method:
    """What trains: the adapter (or, for full fine-tuning, every) parameters, a new head's parameters, the adapted
    modules and the XGBLoRA schedule. `named_params` is what the stepper updates: trainable, then head."""

    trainable: list[tuple[str, torch.nn.Parameter]]
    head: list[tuple[str, torch.nn.Parameter]] = field(default_factory=list)
    modules: dict[str, LoRALinear] = field(default_factory=dict)
    boosting: Boosting | None = None
    contrastive: Contrastive | None = None  # the embedding objective; its learnable temperature trains too

    def __post_init__(self) -> None:
        temperature = [("contrastive.log_scale", self.contrastive.log_scale)] \
            if self.contrastive is not None and self.contrastive.log_scale is not None else []
        self.named_params = [*self.trainable, *self.head, *temperature]  # one list: FSDP replaces its entries in place

    def zo_params(self, head_trainer: str) -> list[tuple[str, torch.nn.Parameter]]:
        """What MeZO perturbs and updates: the trainable weights, and the head only under --head_trainer zo."""
        return self.named_params if head_trainer == "zo" else self.trainable

    def trainable_state(self, with_bases: bool) -> dict[str, torch.Tensor]:
        """Tensors a checkpoint must hold; with_bases adds the (merged-into) base weights of adapted modules."""
        state = dict(self.named_params)
        if with_bases:  # a 4-bit base never changes: its merged boosters are side factors, rebuilt from the history
            state.update({f"{name}.base.weight": m.base.weight for name, m in self.modules.items()
                          if not is_quantized(m.base)})
        return state


def init_head(run: RunSetup, method: Method) -> None:
    """--head_init probe: fit a new classifier head on the frozen model's features of the training examples."""
    if run.cfg.head_init != "probe" or not method.head or run.scoring is None or run.scoring.kind != "classifier":
        return
    cfg = run.cfg
    l2, accuracy = fit_probe(run.model, run.tokenizer, run.splits.train, run.scoring, l2=cfg.head_probe_l2,
                             batch_size=cfg.per_device_eval_batch_size, max_length=cfg.max_length)
    log.info("head: linear probe on %s-pooled features, L2 %g, training accuracy %.3f", cfg.pooling, l2, accuracy)


# Above this alpha/r (twice MeZO's r=8, alpha=16) a MeZO run is warned: its per-step change of B A is 4x MeZO's.
ZO_MAX_SCALING = 4.0


def _warn_on_large_zo_scale(modules: dict[str, LoRALinear]) -> None:
    m = max(modules.values(), key=lambda m: m.scaling)
    if m.scaling > ZO_MAX_SCALING:
        log.warning("--trainer zo with an adapter scale of %g (alpha %g, r %d): MeZO's change of B A per step "
                    "grows with the square of the scale, %gx that of r=8, alpha=16; lower --lora_alpha (default "
                    "2r) if the loss jumps or predictions collapse to one class", m.scaling, m.alpha, m.r,
                    (m.scaling / 2) ** 2)


def setup_method(model: torch.nn.Module, cfg: TrainingOptions, contrastive: Contrastive | None = None) -> Method:
    """Prepare full fine-tuning, LoRA, or XGBLoRA boosters on the model, and say what trains; with --adapter, start
    from that adapter (see continue_from)."""
    if cfg.method == "ft":
        count = prepare_full_ft(model)
        log.info("full fine-tuning: %s trainable parameters", f"{count:,}")
        named = list(model.named_parameters())
        return Method([(n, p) for n, p in named if not is_head_param(n)],
                      [(n, p) for n, p in named if is_head_param(n)], contrastive=contrastive)
    factors, adapter_head = read_adapter(Path(cfg.adapter)) if cfg.adapter else ({}, {})
    model.load_state_dict(adapter_head, strict=False)  # a trained classification head (modules_to_save)
    targets = cfg.lora_target_modules or (exact_targets(factors) if factors else None)
    report = attach(model, targets, r=cfg.rank, alpha=cfg.alpha, dropout=cfg.lora_dropout, rslora=cfg.use_rslora)
    if cfg.method == "lora":
        continue_from(factors, report.modules)
    log.info("%s", report)
    if cfg.trainer == "zo":
        _warn_on_large_zo_scale(report.modules)
    adapters = adapter_params(model)
    head = [(n, p) for n, p in model.named_parameters() if is_head_param(n)]
    for _, p in head:  # a new classification head trains in every method (or stays frozen: see zo_params)
        p.requires_grad_(True)
    boosting = None
    if cfg.method == "xgblora":
        boosting = Boosting(report.modules, layers_per_booster=cfg.xgblora_layers_per_booster,
                            layer_share=cfg.layer_share, shrinkage=cfg.xgblora_shrinkage,
                            adaptive=cfg.xgblora_adaptive, max_booster_steps=cfg.xgblora_adaptive_max_steps,
                            patience=cfg.xgblora_adaptive_patience,
                            threshold=cfg.xgblora_adaptive_threshold, ema=cfg.xgblora_adaptive_ema, seed=cfg.seed)
        if factors:
            boosting.absorb(factors)
        boosting.begin()
    return Method(adapters, head, report.modules, boosting, contrastive)


def continue_from(factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
                  modules: dict[str, LoRALinear]) -> None:
    """LoRA from a trained adapter: each of its modules takes the adapter's A, B, rank and scaling and trains on."""
    check_adapted(factors, modules)
    for name, (A, B, scaling) in factors.items():
        modules[name].load_factors(A, B, scaling)
    if factors:
        log.info("LoRA: continuing from the adapter's %d modules (rank %s)", len(factors),
                 ", ".join(sorted({str(A.shape[0]) for A, _, _ in factors.values()})))


@dataclass
class RunSetup:
    """A loaded run: the resolved config, the task's splits, the model, and the evaluator chosen for it."""

    cfg: TrainerConfig
    task: Task
    splits: Splits
    head: str
    model: torch.nn.Module
    tokenizer: Any
    scoring: LabelScoring | None
    device: torch.device
    evaluate: Evaluator
    generative: Sequence[Example] = ()  # GRIT: --grit_train_file's instruction examples

    @property
    def prefixes(self) -> Prefixes:
        """The instruction prefixes of queries and documents (embedding runs)."""
        return embedding_prefixes(self.cfg.instruction_format, self.cfg.query_instruction, self.cfg.doc_instruction)

    @property
    def stop_ids(self) -> list[int]:
        """Tokens that end an answer: the tokenizer's EOS and the model's generation EOS (e.g. an end-of-turn)."""
        return formats.model_stop_ids(self.model, self.tokenizer)

    @property
    def autocast(self) -> torch.dtype | None:
        """The autocast dtype of training forwards (None: off)."""
        return autocast_dtype(self.cfg, self.device)

    def training_run(self) -> TrainingRun:
        """What the Trainer reads of this run: the dev split scored after training unless --no_eval."""
        return TrainingRun(self.cfg, self.model, self.tokenizer, self.device, self.evaluate, self.splits.monitor,
                           () if self.cfg.no_eval else self.splits.dev)


@dataclass
class TrainingRun:
    """What a Trainer trains and scores: the resolved config, the model and its tokenizer (final/ holds both), its
    device, and the evaluator with the examples it scores during training (`monitor`: --eval_on_start,
    --evaluation_strategy steps, the best step) and after it (`dev`)."""

    cfg: TrainerConfig
    model: torch.nn.Module
    tokenizer: Any
    device: torch.device
    evaluate: Evaluator
    monitor: Sequence = ()
    dev: Sequence = ()

    @property
    def autocast(self) -> torch.dtype | None:
        """The autocast dtype of training forwards (None: off)."""
        return autocast_dtype(self.cfg, self.device)


def loss_model(run: TrainingRun, dist: Distributed) -> tuple[torch.nn.Module, bool]:
    """The model a training loss runs, through torch.compile with --compile, and whether through the fused LM head:
    where asked, except compiled or under FSDP, whose wrapped model gathers the root's weights in its own forward
    (the backbone's skips that)."""
    cfg = run.cfg
    model = torch.compile(run.model) if cfg.compile else run.model
    return model, cfg.fused_lm_head and not cfg.compile and not dist.shards_model


def training_loss(run: TrainingRun, dist: Distributed, contrastive: Contrastive | None = None,
                  preference: PairLoss | None = None, reranker: Reranker | None = None) -> TrainingLoss:
    """The training forward of the run's batches (`TrainingLoss`) on `loss_model`."""
    model, fused = loss_model(run, dist)
    return TrainingLoss(model, run.autocast, contrastive, preference, fused_head=fused, reranker=reranker)


def set_up_run(cfg: Config, dist: Distributed) -> RunSetup:
    """Task, splits, head and model; the config resolved against them and written to config.yaml."""
    transformers.set_seed(cfg.seed)
    cfg = resolve_model(cfg)
    task, splits, head = task_splits_head(cfg)
    if cfg.trainer != "none":
        check_monitor(cfg, splits)
    generative = grit_examples(cfg) if cfg.objective == "grit" and cfg.trainer != "none" else ()
    template = formats.read_chat_template(cfg.chat_template) if cfg.chat_template else None
    if dist.is_main:
        log.info("%s", describe_splits(task, cfg, splits))
    words = label_words(task.name, splits.train, splits.dev, splits.eval) \
        if head not in ("lm", "embed") and cfg.objective != "rerank" else ()
    if head == "classifier" and cfg.label_words and dist.is_main:
        log.warning("--label_words with a classifier head: the words only count and name the labels (%s); the head "
                    "learns one output per label and never reads them (--head lm or mlm scores the words)",
                    ", ".join(w.strip() for w in words))
    if head != "lm" and (cfg.sfc or cfg.icl_sfc):
        raise UserError(f"--sfc/--icl_sfc calibrate a causal LM's candidate scores; --head {head} has no surface forms")
    model, tokenizer = load_model(cfg, dist, head, 1 if cfg.objective == "rerank" else len(words) or None)
    if template is not None:
        tokenizer.chat_template = template
    device = next(model.parameters()).device
    cfg = resolve_task_config(cfg, model, dist, head)
    _warn_on_emulated_bf16(cfg, device)
    if cfg.tf32:
        perf.enable_tf32(device)
    scoring = labels.build_scoring(head, tokenizer, words, cfg.pooling) if words else None
    evaluator = build_evaluator(cfg, task, tokenizer, scoring, formats.model_stop_ids(model, tokenizer))
    return RunSetup(cfg, task, splits, head, model, tokenizer, scoring, device, evaluator, generative)


def task_splits_head(cfg: Config) -> tuple[Task, Splits, str]:
    """The task, its splits (read and checked before any model loads) and the model class the run loads: the
    task's head, an embedding model's, or a reranker's one-output sequence classifier."""
    if cfg.objective == "rerank":
        task = RerankTask(cfg.data)
        splits = sample_splits(task, cfg.data)
        if cfg.trainer != "none":
            check_rows(splits.train, cfg.rerank_loss)
        return task, splits, "classifier"
    if not cfg.embeds:
        task = get_task(cfg.task_name, cfg.data)
        return task, sample_splits(task, cfg.data), pretrained.resolve_head(cfg.head, cfg.model_name,
                                                                            cfg.trust_remote_code)
    task = PairTask(cfg.data)
    splits = sample_splits(task, cfg.data)
    # a document trained on is not a held-out document
    splits = dataclasses.replace(splits, dev=held_apart(splits.train, splits.dev, "dev"),
                                 eval=held_apart(splits.train, splits.eval, "eval"))
    return task, splits, pretrained.embedding_head(cfg.model_name, cfg.objective, cfg.trust_remote_code)


def resolve_model(cfg: Config) -> Config:
    """cfg with --model_name the base model to load and --adapter the adapter folder to put on it (a run or
    adapter folder names its base model)."""
    source = trained.resolve(cfg.model_name, cfg.adapter)
    return dataclasses.replace(cfg, model_name=source.base, adapter=str(source.adapter) if source.adapter else None)


def load_model(cfg: Config, dist: Distributed, head: str, num_labels: int | None = None) -> tuple[torch.nn.Module, Any]:
    """The model (`head`: pretrained.HEAD_CLASSES) and its tokenizer on this rank's device, in the run's dtype and
    attention; an evaluation's --adapter merged in (training starts from it in setup_method)."""
    target = pretrained.choose_device(dist.device or cfg.device)
    model, tokenizer = pretrained.load(cfg.model_name, dtype=cfg.dtype_name, attn_implementation=attention(cfg, head),
                                       device=str(target), trust_remote_code=cfg.trust_remote_code, head=head,
                                       num_labels=num_labels, load_in_4bit=cfg.load_in_4bit,
                                       compute_dtype=_compute_dtype(cfg, target))
    if cfg.adapter is not None and cfg.trainer == "none":
        trained.apply_adapter(model, Path(cfg.adapter), merge=not cfg.load_in_4bit)
    return model, tokenizer


def write_config(run: RunSetup, dist: Distributed) -> None:
    """The resolved config as config.yaml in the output folder (the main process writes it)."""
    if dist.is_main:
        parsing.dump(run.cfg, Path(run.cfg.output_dir) / "config.yaml")


def grit_examples(cfg: Config) -> list[Example]:
    """GRIT's instruction examples for the generative loss, read from --grit_train_file (any form --train_file
    takes) before the model loads, so that a bad file stops the run first."""
    task = CustomTask(dataclasses.replace(cfg.data, train_file=cfg.grit_train_file, eval_file=None, columns=None,
                                         template=None, label_words=None))
    return load_rows(task, "train", None)


def build_evaluator(cfg: Config, task: Task, tokenizer: Any, scoring: LabelScoring | None,
                    stop_ids: Sequence[int]) -> Evaluator:
    """The run's evaluator, from its objective and task: retrieval for embeddings, instructions for instruction
    data, labels for a classifier or masked-LM head, else MeZO's candidate scoring."""
    sizes = EvalSizes(cfg.per_device_eval_batch_size, cfg.max_length, cfg.max_new_tokens)
    if cfg.objective == "rerank":
        return Reranking(tokenizer, sizes)
    if cfg.embeds:
        return Retrieval(tokenizer, cfg.pooling, sizes,
                         embedding_prefixes(cfg.instruction_format, cfg.query_instruction, cfg.doc_instruction),
                         bool(cfg.bidirectional), cfg.pools_prompt)
    if task.instruction:
        return Instructions(tokenizer, tuple(stop_ids), sizes, cfg.train_on_prompt)
    if scoring is not None:
        return Labels(tokenizer, scoring, sizes)
    return Candidates(tokenizer, task, sizes, cfg.sfc, cfg.icl_sfc)


def attention(cfg: Config, head: str) -> str:
    """The attention backend to load: --attn_implementation, but auto is sdpa for a causal LM's bidirectional
    embedding pass (GRIT's default, or --bidirectional): flash-attention kernels take no 4D mask and would run it
    causally."""
    wants_bidirectional = cfg.bidirectional or (cfg.bidirectional is None and cfg.objective == "grit")
    if cfg.attn_implementation == "auto" and head == "lm" and cfg.embeds and wants_bidirectional:
        return "sdpa"
    return cfg.attn_implementation


def check_monitor(cfg: Config, splits: Splits) -> None:
    """Periodic evaluation and best-checkpoint selection read the dev split, never the evaluation (test) split."""
    wants = "--load_best_model_at_end" if cfg.load_best_model_at_end else \
        "--evaluation_strategy steps" if cfg.evaluation_strategy == "steps" else None
    if wants and not splits.monitor:
        own = "--num_dev N or --eval_split_ratio R (held out of --train_file), or --eval_file with your validation " \
              "rows" if cfg.own_data else "--num_dev N (N examples drawn from the train split, disjoint from the " \
                                          "training ones)"
        raise UserError(f"{wants} needs a dev split, and choosing on the evaluation split would report a test score "
                        f"that was used for the choice; pass {own}")


def _compute_dtype(cfg: TrainingOptions, device: torch.device) -> str:
    """The dtype a 4-bit layer computes in: the autocast's, else the weights'."""
    autocast = autocast_dtype(cfg, device)
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(autocast, cfg.dtype_name)


def load_policy(cfg: TrainerConfig, dist: Distributed, template: str | None = None, head: str = "lm",
                num_labels: int | None = None) -> tuple[TrainerConfig, torch.nn.Module, Any]:
    """The model grpo and dpo train (a language model), or reward (`head` classifier: a sequence classifier with
    `num_labels` outputs), and its tokenizer (a run or adapter folder names its base; the adapter itself is set up by
    setup_method), and the config resolved against them (`resolve_config`); TF32 on where asked."""
    transformers.set_seed(cfg.seed)  # before the load, which draws a new head's weights
    cfg = resolve_model(cfg)
    target = pretrained.choose_device(dist.device or cfg.device)
    model, tokenizer = pretrained.load(cfg.model_name, dtype=cfg.dtype_name, attn_implementation=cfg.attn_implementation,
                                       device=str(target), trust_remote_code=cfg.trust_remote_code, head=head,
                                       num_labels=num_labels, load_in_4bit=cfg.load_in_4bit,
                                       compute_dtype=_compute_dtype(cfg, target))
    if template is not None:
        tokenizer.chat_template = template
    if cfg.tf32:
        perf.enable_tf32(next(model.parameters()).device)
    return resolve_config(cfg, model, dist), model, tokenizer


def resolve_config(cfg: TrainerConfig, model: torch.nn.Module, dist: Distributed) -> TrainerConfig:
    """The config that runs: max_length within the model's positions, the rank's device, FSDP's checkpoints."""
    positions = getattr(model.config, "max_position_embeddings", None)
    max_length = min(cfg.max_length, positions) if positions is not None else cfg.max_length
    if max_length < cfg.max_length:
        log.debug("max_length %d exceeds %s's %d positions; using %d", cfg.max_length, cfg.model_name, positions,
                  positions)
    return dataclasses.replace(cfg, max_length=max_length, device=dist.device or cfg.device,
                               save_only_model=cfg.save_only_model or dist.model_only_checkpoints)


def resolve_task_config(cfg: Config, model: torch.nn.Module, dist: Distributed, head: str) -> Config:
    """`resolve_config`, and the classifier's pooling (auto: the model's sentence-transformers pooling, else its own
    [CLS] head) and an embedding run's pooling, attention and temperature."""
    cfg = resolve_config(cfg, model, dist)
    pooling, bidirectional = cfg.pooling, cfg.bidirectional
    if pooling == "auto" and head == "classifier" and cfg.objective == "lm":
        pooling = pretrained.sentence_pooling(cfg.model_name) or "cls"
    embedding_options = {}
    if cfg.embeds:
        check_matryoshka_dims(cfg, model)
        bidirectional = resolve_bidirectional(cfg, model, head)
        embedding_options = {"contrastive_temperature": cfg.similarity_temperature, "include_prompt": cfg.pools_prompt}
        if pooling == "auto":
            pooling = pretrained.sentence_pooling(cfg.model_name) or ("last" if head == "lm" and not bidirectional
                                                                  else "mean")
    return dataclasses.replace(cfg, pooling=pooling, bidirectional=bidirectional, **embedding_options)


def check_matryoshka_dims(cfg: Config, model: torch.nn.Module) -> None:
    """--matryoshka_dims within the model's embedding size, refused before training or scoring starts (the loss
    would fail at the first step); in training, a warning where the full size is not among them, as
    sentence-transformers warns (the uncut embedding, what the model gives by default, is then not trained)."""
    dims, size = cfg.matryoshka[0], getattr(model.config, "hidden_size", None)
    if not dims or size is None:
        return
    if max(dims) > size:
        raise UserError(f"--matryoshka_dims {cfg.matryoshka_dims}: {max(dims)} is above {cfg.model_name}'s "
                        f"embedding size {size}; give sizes of at most {size}")
    if size not in dims and cfg.trainer != "none":
        log.warning("--matryoshka_dims %s leaves out the full embedding size %d: the uncut embedding is not "
                    "trained; add %d unless the model is only used truncated", cfg.matryoshka_dims, size, size)


def resolve_bidirectional(cfg: Config, model: torch.nn.Module, head: str) -> bool:
    """Whether a causal LM's embedding pass attends both ways: --bidirectional, default on for GRIT (probed: a later
    token must change an earlier one's hidden state; a model that ignores the mask is an error, never a silently
    causal pass); encoders already do."""
    if head != "lm" or cfg.bidirectional is False:
        return False
    if cfg.bidirectional is None and cfg.objective != "grit":
        return False
    if not bidirectional_supported(model):
        flag = "--bidirectional" if cfg.bidirectional else f"--objective {cfg.objective} (bidirectional by default)"
        raise UserError(f"{flag}: {model.config.model_type} with {model.config._attn_implementation} attention "
                        f"ignores a bidirectional mask; use --attn_implementation sdpa or eager, or pass "
                        f"--bidirectional false for a causal embedding pass")
    log.info("embedding pass: bidirectional attention")
    return True


def _warn_on_emulated_bf16(cfg: TrainingOptions, device: torch.device) -> None:
    if device.type == "cpu" and (cfg.bf16 or cfg.dtype_name != "float32") and not perf.cpu_has_bf16():
        log.warning("this CPU has no native bf16 arithmetic (no avx512_bf16, AMX or Arm bf16): half precision runs "
                    "emulated, many times slower than fp32 (24x for an all-MiniLM-L6-v2 training step, BENCHMARKS.md); "
                    "drop --bf16 / --load_bfloat16 / --load_float16 on this machine")


def training_set(run: RunSetup) -> TrainingSet:
    """The tokenised training examples, packed or padded, for the run's head and objective."""
    cfg = run.cfg
    if not run.splits.train:
        raise UserError(f"--trainer {cfg.trainer} needs training examples: --num_train is {cfg.num_train}"
                        if cfg.num_train is not None else f"--trainer {cfg.trainer}: no training examples left")
    if cfg.train_as_classification and run.task.generation and run.head == "lm":
        raise UserError(f"--train_as_classification needs answer candidates; {run.task.name} is a generation task "
                        f"(train it on the answer tokens, the default)")
    if cfg.objective == "rerank":
        return rerank_training_set(run.tokenizer, run.splits.train, cfg.max_length, build_reranker(cfg), cfg.seed)
    if cfg.embeds:
        return embedding_training_set(run)
    if run.scoring is not None:
        if not cfg.only_train_option:
            raise UserError(f"--only_train_option false: --head {run.head} scores labels, not tokens of the prompt")
        return label_training_set(run.tokenizer, run.splits.train, cfg.max_length, run.scoring)
    token_mean = cfg.loss_mean == "token" or (cfg.loss_mean == "auto" and run.task.instruction)
    if run.task.instruction:
        seqs = formats.instruction_seqs(run.tokenizer, run.splits.train, cfg.max_length, cfg.train_on_prompt,
                                     run.stop_ids)
        return sequence_training_set(seqs, run.tokenizer.pad_token_id, packing_enabled(run), token_mean,
                                     pad_multiple(run.device))
    return causal_training_set(run.tokenizer, run.splits.train, cfg.max_length, cfg.train_as_classification,
                               packed=packing_enabled(run), token_mean=token_mean,
                               whole_sequence=not cfg.only_train_option, pad_to_multiple_of=pad_multiple(run.device))


def embedding_training_set(run: RunSetup) -> TrainingSet:
    """The pairs (contrastive), or the pairs and --grit_train_file's instruction examples side by side (GRIT)."""
    cfg, tokenizer = run.cfg, run.tokenizer
    pairs = pair_seqs(tokenizer, run.splits.train, cfg.max_length, run.prefixes)
    if cfg.objective == "contrastive":
        return pair_training_set(pairs, tokenizer.pad_token_id)
    seqs = formats.instruction_seqs(tokenizer, run.generative, cfg.max_length, cfg.train_on_prompt, run.stop_ids)
    generative = sequence_training_set(seqs, tokenizer.pad_token_id, token_mean=True)
    return grit_training_set(pairs, generative, tokenizer.pad_token_id, cfg.grit_generative_batch_size)


def build_contrastive(run: RunSetup, dist: Distributed) -> Contrastive | None:
    """The embedding objective of the run (None for --objective lm)."""
    cfg = run.cfg
    if not cfg.embeds:
        return None
    skips = (0, 0) if cfg.pools_prompt else (prefix_length(run.tokenizer, run.prefixes.query),
                                             prefix_length(run.tokenizer, run.prefixes.doc))
    return Contrastive(cfg.pooling, cfg.similarity_temperature, cfg.learnable_temperature, bool(cfg.bidirectional),
                       gather=dist.gather_rows if dist.world_size > 1 else None,
                       weights=(cfg.grit_contrastive_weight, cfg.grit_generative_weight),
                       mini_batch=cfg.mini_batch_size, skips=skips,
                       symmetric=cfg.contrastive_loss == "symmetric", split_cost=split_cost(cfg.embed_pieces, run.device),
                       dims=cfg.matryoshka[0], dim_weights=cfg.matryoshka[1]).to(run.device)


def build_reranker(cfg: Config) -> Reranker | None:
    """A reranker's training loss (None but for --objective rerank)."""
    if cfg.objective != "rerank":
        return None
    return Reranker(cfg.rerank_loss, cfg.rerank_num_negatives if cfg.rerank_loss == "mnrl" else 0,
                    cfg.rerank_weighting_scheme)


def packing_enabled(run: RunSetup) -> bool:
    """Whether training batches are packed: --packing, else on with flash attention; only where the model allows it.

    With sdpa/eager the packed row's block-diagonal mask makes attention cost the square of the whole row: on the
    CPU more than length grouping's few percent of padding on small models, a little less on 1B ones
    (BENCHMARKS.md); flash attention's varlen kernels compute no cross-sequence pairs.
    """
    cfg, model = run.cfg, run.model
    if cfg.packing is False:
        return False
    attention = getattr(model.config, "_attn_implementation", "") or ""
    eligible = run.head == "lm" and not cfg.train_as_classification
    if cfg.packing is None and not (eligible and attention.startswith("flash")):
        return False
    if not eligible:
        raise UserError("--packing needs a causal LM trained on the gold continuation (not --head classifier/mlm or "
                        "--train_as_classification, whose candidates are scored side by side)")
    with torch.autocast(run.device.type, dtype=run.autocast, enabled=run.autocast is not None):  # as in training
        supported = packing_supported(model)
    if supported:
        log.info("packing each training batch into one row (no padding)")
        return True
    if cfg.packing:
        raise UserError(f"--packing: this model ({model.config.model_type}, {attention} attention) lets packed "
                        f"sequences attend to each other; use --packing false (length-grouped padding)")
    log.info("packing is off: %s with %s attention does not keep packed sequences apart", model.config.model_type,
             attention)
    return False


def autocast_dtype(cfg: TrainingOptions, device: torch.device) -> torch.dtype | None:
    """bf16 autocast: on by default on CUDA devices that support it; --bf16 forces it; --fp16 on CUDA only."""
    if cfg.fp16:
        if device.type != "cuda":
            raise UserError("--fp16 autocast needs a CUDA device; on CPU use --bf16 (this CPU may support it)")
        return torch.float16
    use_bf16 = cfg.bf16 if cfg.bf16 is not None else (device.type == "cuda" and torch.cuda.is_bf16_supported())
    if not use_bf16 or cfg.dtype_name != "float32":
        return None
    return torch.bfloat16


def describe_splits(task: Task, cfg: Config, splits: Splits) -> str:
    """One line saying what the run trains on, what it holds out and what it evaluates on, and when."""
    own = isinstance(task, CustomTask)
    if own and cfg.num_train is None:
        parts = [f"training on all {len(splits.train)} examples of {task.train_file}" if not splits.dev else
                 f"training on {len(splits.train)} examples of {task.train_file}"]
    elif cfg.trainer == "none":
        parts = [f"{len(splits.train)} demonstrations" if splits.train else "zero-shot"]
    else:
        parts = [f"training on {len(splits.train)} examples" + (" (MeZO's protocol)" if not own else "")]
    periodic = f"every {cfg.eval_steps} steps" if cfg.evaluation_strategy == "steps" and cfg.trainer != "none" \
        else ""
    dev = f"dev split: {len(splits.dev)} held out" + (f", evaluated {periodic}" if periodic else "")
    parts.append(dev if splits.dev else "no dev split")
    where = task.eval_file if own and task.eval_file else "the rows not drawn" if own else "the validation split"
    if splits.eval and not cfg.no_eval:
        watched = f"{periodic} and " if periodic and not splits.dev and splits.eval_is_own else ""
        parts.append(f"evaluating on {len(splits.eval)} examples of {where} {watched}at the end")
    elif cfg.no_eval:
        parts.append("no final evaluation (--no_eval)")
    else:
        parts.append("no evaluation set (pass --eval_file" + (", --num_dev N or --eval_split_ratio R)" if own else ")"))
    return f"{task.name}: " + "; ".join(parts)
