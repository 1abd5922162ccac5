"""Each command's options class: the groups of options.py it inherits, its own fields, and the rules that span
groups. A command's parser shows exactly its class's fields (parsing.py turns the classes into flags and YAML and
back); no command's class inherits another's, and the bundles below carry the groups and rules they share:

  TrainingOptions      what trains and how (model, rows, method, adapter, boosting, optimiser, ZO, loop)
  TrainerConfig        TrainingOptions with the run's seed and folder: what the Trainer reads (dpo, grpo, train)
  TaskTrainingOptions  TrainingOptions with a task's examples (task, head, embeddings, dev split, ...): train, compare
  SamplerConfig        a model that samples (chat, generate)

IGNORED, at the end, names the options a run would never read under the values of others, by their groups."""

from __future__ import annotations

import dataclasses
import logging
import math
import typing
from dataclasses import dataclass
from typing import Any

from xgblora.checks import (
    check_choices,
    check_finite,
    check_output_paths,
    check_positive,
    check_sampling,
    check_seeds,
    field_default,
    parse_matryoshka,
)
from xgblora.errors import UserError
from xgblora.options import (
    GROUPS,
    MEZO_MAX_NEW_TOKENS,
    MEZO_NUM_TRAIN,
    MIN_BOOSTER_STEPS,
    PAPER_NORM_PENALTY,
    PRESET_BOOSTERS,
    ZO_ESTIMATORS,
    AdamWOptions,
    AdapterOptions,
    AdaptiveBoostingOptions,
    BatchOptions,
    BoostingOptions,
    ClassificationOptions,
    CompileOptions,
    CompletionOptions,
    ComputeOptions,
    ContrastiveOptions,
    EmbeddingOptions,
    GritOptions,
    HeadOptions,
    InputOptions,
    InstructionOptions,
    LoopOptions,
    MemoryOptions,
    MethodOptions,
    ModelOptions,
    MomentumOptions,
    NextTokenOptions,
    OptimizerOptions,
    OutputOptions,
    RerankEvalOptions,
    RerankOptions,
    ResultFileOptions,
    RetrievalOptions,
    RLOOOptions,
    RunOptions,
    SamplingOptions,
    SplitOptions,
    SupervisedOptions,
    TaskOptions,
    ToolOptions,
    ZOHeadOptions,
    ZOOptions,
    _opt,
    check_device_name,
    redefault,
)
from xgblora.trackers import parse_report_to

log = logging.getLogger("xgblora")


@dataclass(frozen=True)
class DataOptions(SplitOptions, ClassificationOptions, TaskOptions, InputOptions):
    """What data/ reads of a run's options: where the rows are, how their columns map, and how many examples each
    split draws (MeZO's protocol for its tasks, every row of the user's own); `TaskTrainingOptions.data` builds it."""

    evaluation_only: bool = False  # --trainer none: an --eval_file is enough


# ----------------------------------------------------------------------------- the checks of one group each

def check_model(cfg: ModelOptions) -> None:
    """The device's name, and one weight dtype."""
    check_device_name(cfg.device)
    if cfg.load_float16 and cfg.load_bfloat16:
        raise UserError("--load_float16 and --load_bfloat16 cannot both be set")


def check_input(cfg: InputOptions) -> None:
    """The length cut leaves a token to score."""
    if cfg.max_length < 2:
        raise UserError(f"--max_length must be at least 2 (a token is scored from the tokens before it), got "
                        f"{cfg.max_length}")


def check_task(cfg: TaskOptions) -> None:
    """The example counts and the sampling seed."""
    for flag in ("num_train", "num_eval"):
        if getattr(cfg, flag) is not None and getattr(cfg, flag) < 0:
            raise UserError(f"--{flag} must be 0 or more, got {getattr(cfg, flag)}")
    check_seeds(cfg, "train_set_seed")


def check_run(cfg: RunOptions) -> None:
    """The seed and the wait for other processes."""
    check_seeds(cfg, "seed")
    check_positive(cfg, "ddp_timeout")


def carried_over(cfg: Any, cls: type) -> dict[str, Any]:
    """The values of cfg's options that the options class cls has too: what a command that runs `xgblora train` runs
    (eval, compare, rft) passes on to each of its runs, the others keeping train's defaults or the values it sets."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name in names}


def resolve_retrieval(cfg: Config | EvalConfig) -> None:
    """A retrieval evaluation (BEIR files) embeds: --objective lm becomes contrastive; a reranker is its second
    stage, never its first."""
    if cfg.retrieval_files is not None and cfg.objective == "rerank":
        raise UserError("--beir_dir scores an embedding model, the first stage of a retrieval; a reranker "
                        "reranks its best documents: give it as --reranker")
    if cfg.retrieval_files is not None and cfg.objective == "lm":
        object.__setattr__(cfg, "objective", "contrastive")


def check_reranking(cfg: Config | EvalConfig) -> None:
    """A retrieval evaluation's second stage: it reranks one first-stage ranking's best documents, the whole
    embedding's or --truncate_dim's (a Matryoshka model's sizes are scored, its whole embedding reranked)."""
    check_positive(cfg, "rerank_top_k", "truncate_dim")
    if cfg.reranker is not None and cfg.retrieval_files is None:
        raise UserError("--reranker reranks the best documents of a retrieval evaluation's first stage: give "
                        "--beir_dir DIR (or --corpus_file, --queries_file and --qrels_file) and the first-stage "
                        "embedding model as --model_name")


def refuse_no_trainer(cfg: MethodOptions, command: str) -> None:
    """A command that trains takes --trainer regular or zo; evaluating alone is xgblora eval's."""
    if cfg.trainer == "none":
        raise UserError(f"--trainer none trains nothing, and xgblora {command} trains: pass --trainer regular or zo "
                        f"(xgblora eval evaluates a model)")


# ----------------------------------------------------------------------------- what trains and how

@dataclass(frozen=True)
class TrainingOptions(LoopOptions, CompileOptions, ComputeOptions, MemoryOptions, ZOOptions, AdamWOptions, MomentumOptions,
                      OptimizerOptions, AdaptiveBoostingOptions, BoostingOptions, AdapterOptions, MethodOptions,
                      InputOptions, ModelOptions):
    """What trains and how: the model and its rows, the method and its adapter or boosters, the optimiser (AdamW or
    MeZO's estimators), the backward pass's memory, the numerics and the loop; every training command's options,
    with the rules among them. Names follow MeZO's run.py, the XGBLoRA fork and TRL."""

    def __post_init__(self) -> None:
        self.resolve_gguf_file()
        self._resolve_method()
        check_finite(self)
        check_choices(self)
        check_model(self)
        check_input(self)
        self._check_training_values()
        self._check_training_combinations()

    def _resolve_method(self) -> None:
        """--lora and --xgblora (MeZO's and the fork's switches) as --method."""
        named = [m for m, flag in (("lora", self.lora), ("xgblora", self.xgblora)) if flag]
        if len(named) > 1 or (named and self.method not in ("ft", named[0])):
            given = [f"--method {self.method}"] * (self.method != "ft") + [f"--{m}" for m in named]
            raise UserError(f"{' and '.join(given)} name different methods; pass one of them")
        if self.xgblora:
            object.__setattr__(self, "method", "xgblora")
        elif self.lora and self.method == "ft":
            object.__setattr__(self, "method", "lora")

    def _check_training_values(self) -> None:
        """One-line errors for options outside their range, each on its own."""
        if self.evaluation_strategy == "steps" and self.eval_steps <= 0:
            raise UserError(f"--eval_steps must be positive with --evaluation_strategy steps, got {self.eval_steps}")
        if self.save_strategy == "steps" and self.save_steps <= 0:
            raise UserError(f"--save_steps must be positive with --save_strategy steps, got {self.save_steps}")
        check_positive(self, "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                       "lora_r", "lora_alpha", "xgblora_steps_per_iteration", "xgblora_num_boosters",
                       "xgblora_adaptive_max_steps", "xgblora_adaptive_patience", "logging_steps", "max_length",
                       "learning_rate", "zo_eps", "zo_queries", "zo_svrg_period", "zo_svrg_anchor_batches",
                       "save_total_limit")
        if self.max_steps == 0 or self.max_steps < -1:
            raise UserError(f"--max_steps must be positive (or -1: train --num_train_epochs epochs), got {self.max_steps}")
        if self.max_steps == -1 and self.num_train_epochs <= 0:
            raise UserError(f"--num_train_epochs must be positive, got {self.num_train_epochs}")
        for name in ("warmup_steps", "weight_decay", "max_grad_norm"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name} must be 0 or more, got {getattr(self, name)}")
        for name in ("lora_dropout", "adam_beta1", "adam_beta2", "xgblora_adaptive_ema", "warmup_ratio"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UserError(f"--{name} must be in [0, 1), got {getattr(self, name)}")
        if self.lora_target_modules is not None and not self.lora_target_modules.strip(" ,"):
            # an empty value would fall back to the default targets without a word
            raise UserError(f"--lora_target_modules {self.lora_target_modules!r} names no module: give name suffixes "
                            f"(q_proj,v_proj), all-linear or a regex, or leave it unset for the default")
        parse_report_to(self.report_to)

    def _check_training_combinations(self) -> None:
        """One-line errors for options that do not go together."""
        if self.load_in_4bit and self.method == "ft" and self.trainer != "none":
            raise UserError("--load_in_4bit trains adapters on a frozen 4-bit base; full fine-tuning cannot update "
                            "4-bit weights: use --method lora or --method xgblora")
        if self.adapter and self.method == "ft" and self.trainer != "none":
            raise UserError("--adapter continues training a LoRA adapter: use --method lora or --method xgblora")
        if self.trainer == "zo" and self.gradient_accumulation_steps != 1:
            raise UserError("--gradient_accumulation_steps does not apply to --trainer zo (MeZO has no gradients to accumulate); "
                            "raise --per_device_train_batch_size instead")
        self._check_boosting()
        if self.trainer == "zo":
            self._check_zo_estimator()

    def _check_boosting(self) -> None:
        """XGBLoRA's booster count, length, layers, start and merge step."""
        if self.xgblora_norm_penalty is not None and self.xgblora_norm_penalty < 0:
            raise UserError(f"--xgblora_norm_penalty must be 0 or more, got {self.xgblora_norm_penalty}")
        if self.xgblora_num_boosters is not None and self.xgblora_steps_per_iteration is not None:
            raise UserError(f"--xgblora_num_boosters {self.xgblora_num_boosters} and --xgblora_steps_per_iteration "
                            f"{self.xgblora_steps_per_iteration} both set how long a booster trains (max_steps / "
                            f"boosters, or that many steps); pass one of them")
        if self.xgblora_layers_per_booster is not None and self.xgblora_layers_per_booster < 1:
            raise UserError(f"--xgblora_layers_per_booster must be at least 1, got {self.xgblora_layers_per_booster}")
        if self.xgblora_init_batches < 1:
            raise UserError(f"--xgblora_init_batches must be at least 1, got {self.xgblora_init_batches}")
        if self.xgblora_init not in (None, "random") and self.trainer == "zo" and self.method == "xgblora":
            raise UserError(f"--xgblora_init {self.xgblora_init} needs the gradient of each adapted weight, a backward pass: "
                            "under --trainer zo a few zeroth-order estimates cannot find its leading direction "
                            "(that takes hundreds of forward pairs per layer); use --xgblora_init random")
        if not 0.0 < self.xgblora_shrinkage <= 1.0:
            raise UserError(f"--xgblora_shrinkage must be in (0, 1], got {self.xgblora_shrinkage}")
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
        self._check_es_population()
        if self.zo_optimizer != "sgd" and self.method == "ft" and self.dtype_name != "float32":
            raise UserError(f"--zo_optimizer {self.zo_optimizer} keeps its state in the weights' dtype, where "
                            f"{self.dtype_name} loses the small updates of full fine-tuning: load fp32 weights or "
                            f"use --zo_optimizer sgd")

    def _check_es_population(self) -> None:
        """--zo_es_sampling, --zo_es_spread and --zo_member_batch shape es's population; the doubled batch carries
        antithetic pairs; members can be spread, or batched, only where each samples the step's prompts itself."""
        changed = [f"--{name} {getattr(self, name)}" for name, default in (("zo_es_sampling", "antithetic"),
                                                                            ("zo_es_spread", "prompts"))
                   if getattr(self, name) != default]
        if changed and self.zo_estimator != "es":
            raise UserError(f"{', '.join(changed)}: the population of --zo_estimator es only, not "
                            f"{self.zo_estimator}")
        if self.zo_es_sampling == "independent" and self.zo_dual:
            raise UserError("--zo_dual: --zo_es_sampling independent perturbs one-sided with a different vector per "
                            "member, which the doubled batch (+z and -z of one vector) cannot carry; drop --zo_dual")
        if self.zo_member_batch < 1:
            raise UserError(f"--zo_member_batch {self.zo_member_batch}: members per batch must be at least 1")
        if self.zo_member_batch > 1 and (self.zo_estimator != "es" or not self.samples_per_member
                                         or self.method == "ft"):
            raise UserError(f"--zo_member_batch {self.zo_member_batch} batches members of --zo_estimator es that "
                            f"sample their own completions (xgblora grpo --zo_objective reward), each on its own "
                            f"perturbed adapter: it needs those, and an adapter method (not --method ft)")
        if self.zo_es_spread == "members" and not self.samples_per_member:
            raise UserError("--zo_es_spread members has every process score its members on all of a step's data: "
                            "that is xgblora grpo --zo_objective reward (each member samples the step's prompts); "
                            "a loss on a batch is split over the processes: use --zo_es_spread prompts")

    @property
    def samples_per_member(self) -> bool:
        """Whether each member of a ZO population samples the step's data itself (grpo's --zo_objective reward) rather
        than scoring a batch that the processes split."""
        return False

    @property
    def methods_used(self) -> set[str]:
        """The methods the command trains (compare: one per --methods entry)."""
        return {self.method}

    @property
    def trainers_used(self) -> set[str]:
        """The trainers the command runs (compare: one per --methods entry)."""
        return {self.trainer}

    @property
    def rank(self) -> int:
        """Adapter rank: --lora_r, else 1 for XGBLoRA boosters and 8 for LoRA."""
        if self.lora_r is not None:
            return self.lora_r
        return 1 if self.method == "xgblora" else 8

    @property
    def alpha(self) -> float:
        """--lora_alpha, else 2r (alpha/r = 2 at every rank, as MeZO's r=8, alpha=16), else under rsLoRA 2 sqrt(8)."""
        if self.lora_alpha is not None:
            return self.lora_alpha
        return 2 * math.sqrt(8) if self.use_rslora else 2.0 * self.rank

    @property
    def norm_penalty(self) -> float:
        """XGBLoRA's lambda: --xgblora_norm_penalty, else the preset's (paper 1e-3, plain 0); 0 for other methods."""
        if self.method != "xgblora":
            return 0.0
        if self.xgblora_norm_penalty is not None:
            return self.xgblora_norm_penalty
        return PAPER_NORM_PENALTY if self.xgblora_preset == "paper" else 0.0

    @property
    def booster_init(self) -> str:
        """Where a booster starts: --xgblora_init, else from the gradient off earlier boosters' directions where there
        is a backward pass (measured: BENCHMARKS.md, "The booster regime"), at random under --trainer zo."""
        if self.xgblora_init is not None:
            return self.xgblora_init
        return "random" if self.trainer == "zo" else "gradient-orthogonal"

    @property
    def layer_share(self) -> float:
        """The share of layers a booster is drawn on when --xgblora_layers_per_booster is unset."""
        return 1 / 3 if self.xgblora_preset == "paper" else 1.0

    def booster_steps(self, max_steps: int) -> int:
        """Steps per booster: --xgblora_steps_per_iteration, else max_steps / --xgblora_num_boosters, else max_steps /
        the preset's count, which under plain falls so that each booster trains at least MIN_BOOSTER_STEPS."""
        if self.xgblora_steps_per_iteration is not None:
            return self.xgblora_steps_per_iteration
        boosters = self.xgblora_num_boosters
        if boosters is None:
            boosters = PRESET_BOOSTERS[self.xgblora_preset]
            if self.xgblora_preset == "plain":
                boosters = max(1, min(boosters, max_steps // MIN_BOOSTER_STEPS))
        return max(1, max_steps // boosters)


@dataclass(frozen=True)
class TrainerConfig(OutputOptions, RunOptions, TrainingOptions):
    """What the Trainer reads (train/loop.py): the training options, the seed and the run's folder. The commands whose
    runs it drives inherit it (train and mezo, dpo, grpo); rft and compare, which make train's options for each of
    their runs, take TrainingOptions."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_run(self)
        check_output_paths(self)


# ----------------------------------------------------------------------------- training on a task's examples

@dataclass(frozen=True)
class TaskTrainingOptions(BatchOptions, ZOHeadOptions, NextTokenOptions, InstructionOptions, RerankOptions,
                          GritOptions, ContrastiveOptions, SupervisedOptions, SplitOptions, EmbeddingOptions,
                          HeadOptions, ClassificationOptions, CompletionOptions, TaskOptions, TrainingOptions):
    """Training on a task's examples (MeZO's tasks, custom classification or instruction data, embedding pairs):
    the training options with the task, the head, the embedding objective, the dev split, instruction SFT and
    batching, and the rules among them (train, mezo and compare)."""

    max_new_tokens: int = redefault(CompletionOptions, "max_new_tokens", MEZO_MAX_NEW_TOKENS)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._resolve_task()
        check_task(self)
        check_positive(self, "head_learning_rate", "head_probe_l2", "contrastive_temperature",
                       "grit_generative_batch_size", "max_new_tokens")
        if self.rerank_num_negatives < -1:
            raise UserError(f"--rerank_num_negatives must be 0 or more (-1: every passage of the batch's other rows), "
                            f"got {self.rerank_num_negatives}")
        if self.trainer == "none" and self.method != "ft":
            named = "--xgblora" if self.xgblora else "--lora" if self.lora else f"--method {self.method}"
            raise UserError(f"{named} {self.method!r} does nothing here: nothing trains under --trainer none (what "
                            f"xgblora eval and xgblora mezo run by default); drop it, or train with xgblora train")
        if (self.grit_generative_batch_size or 0) > self.per_device_train_batch_size:
            raise UserError(f"--grit_generative_batch_size {self.grit_generative_batch_size} takes the instruction "
                            f"examples of a batch's first pairs: at most --per_device_train_batch_size "
                            f"{self.per_device_train_batch_size}")
        self._check_objective()

    def _resolve_task(self) -> None:
        """A classifier's prompt and classes on custom rows, MeZO's --num_train for its tasks, and the dev split's
        sizing."""
        if self.head == "classifier" and self.task_name == "custom" and not (self.template or self.label_words):
            # a classifier scores class indices, not words: the text is the prompt and the label names the classes
            object.__setattr__(self, "template", "{text}")
            object.__setattr__(self, "label_words", self.label_names or "0,1")
        if self.num_train is None and not self.own_data:
            object.__setattr__(self, "num_train", MEZO_NUM_TRAIN)
        if self.num_dev is not None and self.num_dev < 0:
            raise UserError(f"--num_dev must be 0 or more, got {self.num_dev}")
        if self.eval_split_ratio is not None:
            if not self.own_data:
                raise UserError(f"--eval_split_ratio holds out a share of your own --train_file; task "
                                f"{self.task_name} follows MeZO's protocol: pass --num_dev N")
            if self.num_dev is not None:
                raise UserError("--num_dev and --eval_split_ratio both size the dev split; pass one of them")
            if not 0.0 < self.eval_split_ratio < 1.0:
                raise UserError(f"--eval_split_ratio must be in (0, 1), got {self.eval_split_ratio}")

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
        if self.mini_batch_size < 0 or (self.mini_batch_size and not self.embeds):
            raise UserError(f"--mini_batch_size (gradient caching) takes a number of rows with --objective "
                            f"contrastive or grit, got {self.mini_batch_size} with --objective {self.objective}")
        parse_matryoshka(self.matryoshka_dims, self.matryoshka_weights)
        if not self.only_train_option and (self.train_as_classification or self.objective != "lm"
                                           or self.task_name.lower() == "custom"):
            raise UserError("--only_train_option false puts the loss on every token of a MeZO task's prompt and "
                            "gold candidate; it has no meaning with --train_as_classification, an embedding "
                            "objective or custom data (instruction data: --train_on_prompt)")

    @property
    def groups_by_length(self) -> bool:
        """Whether training batches group examples of similar length: --group_by_length, else only for --objective
        lm."""
        return self.objective == "lm" if self.group_by_length is None else self.group_by_length

    @property
    def similarity_temperature(self) -> float:
        """--contrastive_temperature, else 0.02 for grit (GritLM's arguments.py) and 0.05 for contrastive."""
        if self.contrastive_temperature is not None:
            return self.contrastive_temperature
        return 0.02 if self.objective == "grit" else 0.05

    @property
    def matryoshka(self) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """--matryoshka_dims and their weights (default 1 each); () and () without Matryoshka embeddings."""
        return parse_matryoshka(self.matryoshka_dims, self.matryoshka_weights)

    @property
    def pools_prompt(self) -> bool:
        """--include_prompt, else off for grit (GritLM masks the instruction out of the pooling) and on otherwise."""
        return self.include_prompt if self.include_prompt is not None else self.objective != "grit"

    @property
    def data(self) -> DataOptions:
        """The data options, as data/ receives them."""
        names = [f.name for f in dataclasses.fields(DataOptions) if f.name != "evaluation_only"]
        return DataOptions(**{name: getattr(self, name) for name in names}, evaluation_only=self.trainer == "none")


@dataclass(frozen=True)
class Config(ResultFileOptions, RerankEvalOptions, RetrievalOptions, TaskTrainingOptions, TrainerConfig):
    """Options of `xgblora train` and `xgblora mezo`: training on a task's examples in a run folder, with MeZO's result
    file, or under --trainer none evaluating (on BEIR files too); `xgblora eval` runs on them (EvalConfig.run_config),
    as rft's and compare's runs do."""

    def __post_init__(self) -> None:
        resolve_retrieval(self)
        super().__post_init__()
        check_reranking(self)
        if self.retrieval_files is not None and self.trainer != "none":
            raise UserError(f"--beir_dir (or --corpus_file, --queries_file, --qrels_file) names a retrieval "
                            f"evaluation, which trains nothing; drop --trainer {self.trainer}, or run xgblora eval")


@dataclass(frozen=True)
class CompareConfig(TaskTrainingOptions):
    """Options of `xgblora compare`: the task-training options plus the methods, seeds and where the report goes;
    each run is an `xgblora train` run (compare.run_configs)."""

    trainer: str = _opt("zo", "Trainer of the methods given without one (METHOD:TRAINER names its own).", ("regular", "zo"))
    output_root: str = _opt("compare", "Folder holding one sub-folder per run and the report.")
    loss_figure_path: str | None = _opt(None, "Where to write the loss figure (default <output_root>/loss.png).")
    seeds: list[int] = _opt([0], "Seeds to run each method with.")
    methods: list[str] = _opt(["xgblora", "lora"], "Methods to compare: ft, lora, xgblora, optionally as method:trainer (e.g. lora:regular), the trainer also a ZO estimator (lora:fzoo, lora:svrg, lora:nspsa, lora:mezo).")
    overwrite: bool = _opt(False, "Redo runs that already finished.")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_seeds(self, "seeds")
        check_output_paths(self)

    @property
    def methods_used(self) -> set[str]:
        return {spec.partition(":")[0] for spec in self.methods}

    @property
    def trainers_used(self) -> set[str]:
        named = {spec.partition(":")[2] or self.trainer for spec in self.methods}
        return {"zo" if trainer in ZO_ESTIMATORS else trainer for trainer in named}


@dataclass(frozen=True)
class EvalConfig(ResultFileOptions, OutputOptions, RunOptions, ComputeOptions, RerankEvalOptions, RetrievalOptions,
                 EmbeddingOptions, HeadOptions, ClassificationOptions, CompletionOptions, TaskOptions, InputOptions,
                 ModelOptions):
    """Options of `xgblora eval`: a model (a trained run's too), the task and its rows or BEIR files, the head or
    embedding that scores them, the numerics, the seed and the run folder; nothing trains."""

    max_new_tokens: int = redefault(CompletionOptions, "max_new_tokens", MEZO_MAX_NEW_TOKENS)

    def __post_init__(self) -> None:
        self.resolve_gguf_file()
        resolve_retrieval(self)
        check_finite(self)
        check_choices(self)
        check_model(self)
        check_input(self)
        check_task(self)
        check_run(self)
        check_positive(self, "per_device_eval_batch_size", "max_length", "max_new_tokens")
        check_output_paths(self)
        check_reranking(self)

    @property
    def trainers_used(self) -> set[str]:
        """The trainers the command runs: none."""
        return {"none"}

    def run_config(self) -> Config:
        """The options of the run that evaluates: train's, with this evaluation's values and --trainer none."""
        return Config(**carried_over(self, Config), trainer="none")


# ----------------------------------------------------------------------------- a model that samples

@dataclass(frozen=True)
class SamplerConfig(SamplingOptions, CompletionOptions, ModelOptions):
    """A model that samples replies: the model, how it samples, the conversation's template (chat, generate)."""

    model_name: str = _opt("tiny-llama-chat", "A base model (hub id, folder, pkg:, built-in), a merged model, a PEFT adapter folder, or an xgblora run directory.")
    chat_template: str | None = _opt(None, "A Jinja chat template file, replacing the tokenizer's.")
    system_prompt: str | None = _opt(None, "A system turn before the conversation.")
    max_length: int = _opt(4096, "Longest prompt in tokens; longer ones are cut from the left.")
    seed: int = _opt(0, "Seed of the sampling (the same seed gives the same completions, also after a resume).")

    def __post_init__(self) -> None:
        self.resolve_gguf_file()
        check_finite(self)
        check_choices(self)
        check_sampling(self)
        check_positive(self, "max_new_tokens", "max_length")
        check_seeds(self, "seed")
        check_device_name(self.device)


@dataclass(frozen=True)
class ChatConfig(SamplerConfig):
    """Options of `xgblora chat`: a model, how it samples, and the conversation's template."""


@dataclass(frozen=True)
class GenerateConfig(SamplerConfig):
    """Options of `xgblora generate`: a model that samples, the prompts file and where the completions go."""

    num_return_sequences: int = _opt(1, "Completions per prompt (each prompt runs once; its KV cache is shared by them).",
                                     aliases=("num_samples",))
    input_file: str | None = _opt(None, "Prompts: rows with a prompt (a string or a list of messages) or messages, in any form --train_file takes.")
    output_file: str = _opt("generations.jsonl", "Where the completions go (JSONL: each input row with its completions); an interrupted run continues from its .partial file.")
    columns: str | None = _opt(None, "Map your column names to ours, OURS=THEIRS (e.g. prompt=question).")
    raw_prompts: bool = _opt(False, "Send string prompts as they are, even when the tokenizer has a chat template (by default a string prompt becomes a user turn).")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_sampling(self, self.num_return_sequences)
        check_output_paths(self)
        if not self.input_file:
            raise UserError("xgblora generate needs --input_file (a JSONL, CSV, parquet... file of prompts)")




# ----------------------------------------------------------------------------- sampling and reinforcement

@dataclass(frozen=True)
class RFTConfig(SamplingOptions, CompletionOptions, BatchOptions, NextTokenOptions, InstructionOptions, RunOptions,
                TrainingOptions):
    """Options of `xgblora rft`: the training options of every round (an `xgblora train` run on instruction rows:
    training_config) plus sampling and verification. --train_file holds the questions with their reference answers, --eval_file the held-out ones."""

    num_return_sequences: int = _opt(1, "Completions per prompt (each prompt runs once; its KV cache is shared by them).",
                                     aliases=("num_samples",))
    rounds: int = _opt(1, "Rounds of sample -> verify -> train -> evaluate; each samples from and trains on the last round's model.")
    sampler_model: str | None = _opt(None, "A model (e.g. a larger one) that samples every round, instead of the model being trained.")
    keep_per_prompt: int | None = _opt(None, "Most correct, distinct completions kept per question (default: all, as RFT's reference keeps them).")
    distinct: str = _opt("equations", "Which correct completions count as the same: equations (the same <<a*b=c>> annotations; the most different is kept) or text (exact copies).",
                         ("equations", "text"))
    check_equations: bool = _opt(True, "Reject a correct completion whose calculator annotations <<lhs=rhs>> do not hold (lhs evaluated, within 1e-3 of rhs), as RFT's reference does.")
    include_gold: bool = _opt(False, "Also train on each question's reference solution (RFT trains on the SFT data plus the samples; off here as --model_name has usually been fine-tuned on it already).")
    restart_from_base: bool = _opt(False, "Each round trains the starting model (--model_name with its --adapter) anew, as STaR and ReST-EM; sampling still uses the last round's model.")
    rationalize: bool = _opt(False, "STaR's rationalisation: questions with no correct sample are sampled again with the reference answer as a hint; correct hinted completions are trained on under the original question.")
    verifier: str = _opt("gsm8k", "How an answer is read: gsm8k (the first number after the first ####), math (math-verify), answer_tags (<answer>...</answer>), regex:PATTERN, or module:function.")
    answer_tolerance: float = _opt(1e-6, "Numbers agree within this relative tolerance.")
    pass_k: int = _opt(8, "Held-out evaluation: pass@k at --temperature (besides greedy pass@1); 0 for pass@1 only.")
    pass_n: int | None = _opt(None, "Held-out evaluation: samples drawn per question for pass@k, n >= k (the unbiased estimator 1 - C(n-c, k) / C(n, k) of Chen et al. 2021; default k).")
    raw_prompts: bool = _opt(False, "Send string prompts as they are, even when the tokenizer has a chat template.")
    output_root: str = _opt("rft", "Folder holding one sub-folder per round and the report.")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_run(self)
        check_output_paths(self)
        refuse_no_trainer(self, "rft")
        check_sampling(self, self.num_return_sequences)
        check_positive(self, "rounds", "keep_per_prompt", "max_new_tokens", "pass_n")
        if self.pass_k < 0:
            raise UserError(f"--pass_k must be 0 or more, got {self.pass_k}")
        if self.pass_n is not None and self.pass_n < self.pass_k:
            raise UserError(f"--pass_n {self.pass_n} must be at least --pass_k {self.pass_k}")
        if not self.train_file or not self.eval_file:
            raise UserError("xgblora rft needs --train_file (questions with reference answers to sample on) and "
                            "--eval_file (held-out questions to measure on)")



@dataclass(frozen=True)
class GRPOConfig(ToolOptions, RLOOOptions, SamplingOptions, CompletionOptions, TrainerConfig):
    """Options of `xgblora grpo`: the Trainer's options (method, trainer, optimiser, checkpoints) plus GRPO's, under TRL's
    GRPOConfig names where TRL has them. --train_file holds the prompts, --eval_file the held-out ones (pass@1)."""

    num_return_sequences: int = _opt(8, "Completions per prompt, G (TRL's num_generations): each prompt runs once and its KV cache is shared by them.",
                                     aliases=("num_generations", "num_samples"))
    temperature: float = _opt(1.0, "Sampling temperature (the log-probabilities of the loss are taken at it too, as TRL does).")
    reward_funcs: list[str] | None = _opt(None, "Reward functions: gsm8k, math, answer_tags, regex:PATTERN (1 if the answer is right), format:<one of those> (1 if there is an answer), module:function. Default: gsm8k, or none beside --reward_model or --environment_factory.")
    reward_model: str | None = _opt(None, "A reward model that scores each prompt + completion, as TRL's GRPOTrainer does (its first output on the chat template's text): a sequence classifier with one output, e.g. an xgblora reward run (its folder, final/ or a merged export), a model folder or hub id; it comes before --reward_funcs, in --reward_weights too.",
                                    aliases=("reward_model_name_or_path",))
    reward_weights: list[float] | None = _opt(None, "Weight of each reward source in the total reward, --reward_model first (default: 1 each).")
    multi_objective_aggregation: str = _opt("sum_then_normalize", "Several reward functions: sum the weighted rewards, then form advantages (sum_then_normalize), or normalise each in its group first (normalize_then_sum: GDPO).",
                                            ("sum_then_normalize", "normalize_then_sum"))
    answer_tolerance: float = _opt(1e-6, "Correctness rewards: numbers agree within this relative tolerance.")
    beta: float = _opt(0.0, "KL coefficient to the reference policy, the model as it started, 0 or more (0, TRL's default: no reference pass).")
    epsilon: float = _opt(0.2, "Clipping: the ratio is kept within [1 - epsilon, 1 + epsilon_high].")
    epsilon_high: float | None = _opt(None, "Upper clipping epsilon, at least --epsilon (default: epsilon; DAPO uses 0.28); under --policy_loss cispo the cap of the ratio itself, at least 1 (ScaleRL's epsilon_max: 5).")
    policy_loss: str = _opt("dapo", "The policy-gradient loss, TRL's loss_type: how token losses add up, grpo, bnpo, dr_grpo, dapo (TRL's: the mean over the generation batch's tokens), or cispo (MiniMax-M1; needs --epsilon_high, about 5).",
                            ("grpo", "bnpo", "dr_grpo", "dapo", "cispo"), aliases=("loss_type",))
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
    disable_dropout: bool = _opt(False, "The loss's forwards and the old and reference log-probabilities without the model's dropout; off by default, as TRL's GRPO (sampling and --trainer zo never apply dropout).")
    eval_on_start: bool = _opt(True, "Evaluate the held-out prompts (--eval_file) before the first step too: results.json's before_ figures.")
    raw_prompts: bool = _opt(True, "Send string prompts as they are, as TRL does (conversational rows always get the chat template); false renders each string as a user turn of the chat template.")
    zo_objective: str = _opt("loss", "--trainer zo: what a perturbation is scored by: GRPO's loss on the step's completions (loss), or the mean reward of the completions the perturbed policy samples itself (reward: evolution strategies, with --zo_estimator es; --temperature 0 --num_generations 1 scores greedy answers).",
                             ("loss", "reward"))

    def __post_init__(self) -> None:
        if self.reward_funcs is None:  # an environment may own the reward (its get_reward)
            object.__setattr__(self, "reward_funcs", [] if self.reward_model or self.environment_factory else ["gsm8k"])
        super().__post_init__()
        refuse_no_trainer(self, "grpo")
        if self.method == "lora" and self.lora_target_modules is None and self.adapter is None:
            # RL's small updates gain from coverage more than from rank ("LoRA without regret"); on SmolLM2 addition
            # (BENCHMARKS.md, GRPO) every linear layer did as well as q/v or better, and learned sooner
            object.__setattr__(self, "lora_target_modules", "all-linear")
        check_sampling(self, self.num_return_sequences)
        check_positive(self, "max_new_tokens", "num_iterations", "generation_batch_size", "steps_per_generation",
                       "tool_timeout")
        if (self.max_tool_calling_iterations or 0) < 0:
            raise UserError(f"--max_tool_calling_iterations must be 0 or more, got {self.max_tool_calling_iterations}")
        if self.zo_objective == "reward":
            self._check_reward_objective()
            object.__setattr__(self, "zo_dual", False)  # the default (on where it applies) never applies here
        elif self.temperature == 0:
            raise UserError("--temperature 0 samples one greedy completion G times: GRPO needs a temperature above 0")
        elif self.num_return_sequences < 2:
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
        self._check_clipping()
        self._check_rewards()

    def _check_rewards(self) -> None:
        """At least one reward source, a weight for each, and RLOO's reward clipping range."""
        sources = len(self.reward_funcs) + (self.reward_model is not None)
        if not sources and not self.environment_factory:  # whether the environment has get_reward: once imported
            raise UserError("--reward_funcs: give at least one reward function, or a --reward_model")
        if self.reward_weights is not None and len(self.reward_weights) != sources:
            named = f"{len(self.reward_funcs)} --reward_funcs" + (" and a --reward_model" if self.reward_model else "")
            raise UserError(f"--reward_weights has {len(self.reward_weights)} values for {named}")
        if self.reward_clip_range is not None and (len(self.reward_clip_range) != 2
                                                   or self.reward_clip_range[0] > self.reward_clip_range[1]):
            raise UserError(f"--reward_clip_range {' '.join(map(str, self.reward_clip_range))}: give MIN MAX, "
                            f"MIN at most MAX")
        if self.advantage_estimator == "rloo" and self.zo_objective == "reward":
            raise UserError("--advantage_estimator rloo forms advantages from a group's completions; --zo_objective "
                            "reward scores perturbed policies by their mean reward instead: drop one of them")

    def _check_clipping(self) -> None:
        """The KL weight and the clipping epsilons. cispo's --epsilon_high caps the importance ratio itself (TRL's
        epsilon_high there is ScaleRL's epsilon_max, its --epsilon unused); the other losses keep the ratio within
        [1 - epsilon, 1 + epsilon_high]."""
        if self.beta < 0:
            raise UserError(f"--beta must be 0 (no KL term) or more, got {self.beta}")
        if self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise UserError("--epsilon and --epsilon_high must be 0 or more")
        if self.policy_loss == "cispo":
            cap = self.epsilon if self.epsilon_high is None else self.epsilon_high
            if cap < 1:  # TRL's default (epsilon_high = epsilon = 0.2) included: it only scales the gradient down
                unset = " (unset, it is --epsilon)" if self.epsilon_high is None else ""
                raise UserError(f"--policy_loss cispo caps each token's importance ratio at --epsilon_high{unset}: "
                                f"{cap} is below 1, the ratio of every token of the sampling policy, so it would clip "
                                f"them all; pass --epsilon_high 5 (ScaleRL's epsilon_max, TRL's advice)")
        elif self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            raise UserError(f"--epsilon_high {self.epsilon_high} is below --epsilon {self.epsilon}: the ratio is kept "
                            f"within [1 - epsilon, 1 + epsilon_high], and epsilon_high widens the upper side (DAPO: "
                            f"0.28 with 0.2); pass at least --epsilon, or leave it unset (= --epsilon)")

    def _check_reward_objective(self) -> None:
        """--zo_objective reward: every perturbed policy samples the step's prompts itself, so there is no sampled batch
        to reuse, no log-probability to compare with a reference, and no doubled batch to carry two policies."""
        if self.trainer != "zo":
            raise UserError("--zo_objective reward scores perturbed policies: it needs --trainer zo")
        if self.beta:
            raise UserError(f"--beta {self.beta}: --zo_objective reward maximises the reward alone (no log-probabilities "
                            f"to hold to a reference); drop --beta")
        if self.num_iterations != 1 or self.generation_batch() != self.optimizer_batch:
            raise UserError("--zo_objective reward samples the prompts of each step anew: drop --num_iterations, "
                            "--generation_batch_size and --steps_per_generation")
        if self.zo_member_batch > 1 and (self.tools or self.environment_factory):
            raise UserError(f"--zo_member_batch {self.zo_member_batch}: tool rollouts sample turn by turn, one member "
                            f"at a time; drop --zo_member_batch or the tools")
        if self.zo_dual:
            raise UserError("--zo_dual: under --zo_objective reward each perturbed policy samples its own completions, "
                            "which one forward over a doubled batch cannot do; drop --zo_dual")

    @property
    def samples_per_member(self) -> bool:
        """--zo_objective reward: each member of the population samples the step's prompts itself."""
        return self.zo_objective == "reward"

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


# ----------------------------------------------------------------------------- preference training

@dataclass(frozen=True)
class RewardConfig(ZOHeadOptions, BatchOptions, TrainerConfig):
    """Options of `xgblora reward`: the Trainer's options (method, trainer, optimiser, checkpoints) plus TRL's
    RewardConfig's, and how the new score head trains under --trainer zo. --train_file holds the pairs (prompt,
    chosen, rejected, and a margin column if any), --eval_file held-out ones (preference accuracy)."""

    center_rewards_coefficient: float | None = _opt(None, "Add this coefficient times the mean of (r_chosen + r_rejected)^2 to the loss, so that the rewards centre on 0 (Eisenstein et al. 2023, Eq. 2; TRL recommends 0.01); unset: no such term.")
    disable_dropout: bool = _opt(True, "Training forwards without the model's dropout (TRL's default); false keeps it (--trainer zo never applies it).")

    def __post_init__(self) -> None:
        super().__post_init__()
        refuse_no_trainer(self, "reward")
        check_positive(self, "head_learning_rate")
        if not self.train_file:
            raise UserError("xgblora reward needs --train_file (preference pairs: chosen, rejected, and a prompt "
                            "unless both hold it)")
        if self.center_rewards_coefficient is not None and self.center_rewards_coefficient < 0:
            raise UserError(f"--center_rewards_coefficient must be 0 or more (TRL recommends 0.01), got "
                            f"{self.center_rewards_coefficient}")


DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo", "sft")
DPO_POLICY_ONLY = ("simpo", "orpo", "sft")  # the loss types that read no reference


@dataclass(frozen=True)
class DPOConfig(CompletionOptions, BatchOptions, TrainerConfig):
    """Options of `xgblora dpo`: the Trainer's options (method, trainer, optimiser, checkpoints) plus preference
    training's, under TRL's DPOConfig names (CPOConfig's simpo_gamma). --train_file holds the pairs, --eval_file
    held-out ones (reward accuracy)."""

    loss_type: list[str] = _opt(["sigmoid"], "Preference losses (TRL's): sigmoid (DPO), ipo, hinge, robust (with label_smoothing), simpo and orpo (no reference model), sft (the chosen completions' NLL); several, each given once, add up with --loss_weights.")
    loss_weights: list[float] | None = _opt(None, "Weight of each --loss_type (default: 1 each).")
    beta: float = _opt(0.1, "Temperature of the implicit reward beta (IPO's tau; SimPO's and ORPO's beta).")
    label_smoothing: float = _opt(0.0, "Probability that a pair's preference is flipped (robust, simpo), in [0, 0.5).")
    simpo_gamma: float = _opt(0.5, "SimPO's target reward margin gamma, 0 or more (TRL's CPOConfig).")
    reference_free: bool = _opt(False, "Take the reference's log-probabilities as 0 (no reference forward).")
    rpo_alpha: float | None = _opt(None, "RPO: add the chosen completions' NLL with this positive weight (TRL's loss_type sft beside sigmoid).")
    max_prompt_length: int | None = _opt(None, "Keep each prompt's last N tokens, N below --max_length (before --max_length cuts prompt + completion at the end).")
    precompute_ref_log_probs: bool = _opt(False, "Compute the reference's log-probabilities of every pair once before training (always so for XGBLoRA, full fine-tuning and a continued --adapter); refused where the loss reads no reference (--reference_free, or only simpo, orpo and sft).")
    precompute_ref_batch_size: int | None = _opt(None, "Pairs per forward while precomputing (default: per_device_eval_batch_size).")
    disable_dropout: bool = _opt(True, "Training forwards without the model's dropout (TRL's default), so the policy scores a pair as the reference does and the first step's loss is log 2; false keeps the model's dropout (--trainer zo never applies it).")
    verifier: str | None = _opt(None, "Also score one greedy completion of each --eval_file prompt against its row's reference field: gsm8k, math, answer_tags, regex:PATTERN or module:function; eval_pass@1.")

    def __post_init__(self) -> None:
        super().__post_init__()
        refuse_no_trainer(self, "dpo")
        if not self.train_file:
            raise UserError("xgblora dpo needs --train_file (preference pairs: prompt, chosen, rejected)")
        if self.verifier and not self.eval_file:
            raise UserError("--verifier checks greedy completions of the --eval_file prompts: give --eval_file")
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
        check_positive(self, "max_prompt_length", "precompute_ref_batch_size", "max_new_tokens")
        self._check_loss_terms()
        self._check_lengths_and_reference()

    def _check_loss_terms(self) -> None:
        """The loss types and their weights: each type once, no negative weight or margin."""
        twice = [t for t in dict.fromkeys(self.loss_type) if self.loss_type.count(t) > 1]
        if twice:
            raise UserError(f"--loss_type {' '.join(self.loss_type)}: {twice[0]} is given twice; give each loss type "
                            f"once and weight it with --loss_weights")
        if any(w < 0 for w in self.loss_weights or ()):
            raise UserError(f"--loss_weights must be 0 or more, got {' '.join(map(str, self.loss_weights))}")
        if self.rpo_alpha is not None and self.rpo_alpha <= 0:
            raise UserError(f"--rpo_alpha must be positive (the weight of the chosen completions' NLL; leave it "
                            f"unset for none), got {self.rpo_alpha}")
        if self.simpo_gamma < 0:
            raise UserError(f"--simpo_gamma must be 0 or more (SimPO's target margin by which the chosen reward "
                            f"beats the rejected one), got {self.simpo_gamma}")

    def _check_lengths_and_reference(self) -> None:
        """A prompt cut that leaves room for the completion, and a precomputed reference that the loss reads."""
        if self.max_prompt_length is not None and self.max_prompt_length >= self.max_length:
            raise UserError(f"--max_prompt_length {self.max_prompt_length} leaves no room under --max_length "
                            f"{self.max_length} (prompt and completion): a prompt that long would keep no "
                            f"completion token and its pair would be dropped; pass a --max_prompt_length below "
                            f"--max_length")
        if self.precompute_ref_log_probs and not self.reads_reference:
            why = ("--reference_free takes the reference's log-probabilities as 0" if self.reference_free else
                   f"--loss_type {' '.join(self.loss_terms[0])} reads no reference ({', '.join(DPO_POLICY_ONLY)} "
                   f"do not)")
            raise UserError(f"--precompute_ref_log_probs computes log-probabilities that nothing reads: {why}; "
                            f"drop it")

    @property
    def reads_reference(self) -> bool:
        """Whether the loss reads the reference's log-probabilities."""
        return not self.reference_free and any(t not in DPO_POLICY_ONLY for t in self.loss_terms[0])

    @property
    def loss_terms(self) -> tuple[tuple[str, ...], tuple[float, ...]]:
        """The loss types and their weights, RPO's sft term included."""
        weights = tuple(self.loss_weights or [1.0] * len(self.loss_type))
        if self.rpo_alpha is None:
            return tuple(self.loss_type), weights
        return (*self.loss_type, "sft"), (*weights, self.rpo_alpha)


# ----------------------------------------------------------------------------- preference training on unpaired rows

@dataclass(frozen=True)
class KTOConfig(BatchOptions, TrainerConfig):
    """Options of `xgblora kto`: the Trainer's options (method, trainer, optimiser, checkpoints) plus KTO's on unpaired
    rows (a completion and whether it is desirable), under TRL's KTOConfig names. --train_file holds the rows
    (prompt, completion, label), --eval_file held-out ones."""

    loss_type: str = _opt("kto", "kto (KTO's loss, with its KL estimate from mismatched prompt/completion pairs) or apo_zero_unpaired (APO-zero's unpaired loss: no KL term).",
                          ("kto", "apo_zero_unpaired"))
    beta: float = _opt(0.1, "How far the policy may move from the reference: the rewards are beta times the log ratios; higher keeps it closer.")
    desirable_weight: float = _opt(1.0, "Weight of the desirable rows' losses (to balance unequal numbers of desirable and undesirable rows).")
    undesirable_weight: float = _opt(1.0, "Weight of the undesirable rows' losses.")
    precompute_ref_log_probs: bool = _opt(False, "Compute the reference's log-probabilities of every row (and its KL completion) once before training (always so for XGBLoRA, full fine-tuning and a continued --adapter).")
    precompute_ref_batch_size: int | None = _opt(None, "Rows per forward while precomputing (default: per_device_eval_batch_size).")
    disable_dropout: bool = _opt(True, "Training forwards without the model's dropout (TRL's default), so the policy scores a row as the reference does and the first step's log ratios are 0; false keeps the model's dropout (--trainer zo never applies it).")

    def __post_init__(self) -> None:
        super().__post_init__()
        refuse_no_trainer(self, "kto")
        if not self.train_file:
            raise UserError("xgblora kto needs --train_file (unpaired rows: prompt, completion, label)")
        if self.beta <= 0:
            raise UserError(f"--beta must be positive, got {self.beta}")
        for name in ("desirable_weight", "undesirable_weight"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name} must be 0 or more, got {getattr(self, name)}")
        check_positive(self, "precompute_ref_batch_size")
        if self.loss_type == "kto" and self.per_device_train_batch_size < 2:
            raise UserError("--loss_type kto estimates its KL term from each row's prompt with another row's "
                            "completion in the batch: --per_device_train_batch_size must be 2 or more (with 1, the "
                            "KL term would be the row's own reward)")



# ----------------------------------------------------------------------------- options a run would ignore

@dataclass(frozen=True)
class Ignored:
    """Options a run never reads while `applies(cfg)` holds: refused, once changed from their default, with `reason`
    (why they do nothing there, and what to pass instead). `options`: groups (all their fields) or single options;
    `when`: the group whose values `applies` reads (a command without it never meets the rule)."""

    options: tuple[type | str, ...]
    when: type
    applies: typing.Callable[[Any], bool]
    reason: str

    def names(self, cls: type) -> list[str]:
        """The rule's options that cls has."""
        have = {f.name for f in dataclasses.fields(cls)}
        named = [f.name for o in self.options if isinstance(o, type) for f in dataclasses.fields(o)]
        return [n for n in [*named, *(o for o in self.options if isinstance(o, str))] if n in have]


# What nothing reads when nothing trains (--trainer none): every group that only training reads
TRAINING_GROUPS = (AdapterOptions, BoostingOptions, AdaptiveBoostingOptions, OptimizerOptions, MomentumOptions,
                   AdamWOptions, ZOOptions, ZOHeadOptions, LoopOptions, SupervisedOptions, ContrastiveOptions,
                   GritOptions, RerankOptions, NextTokenOptions, MemoryOptions, BatchOptions)
ZO_GROUPS = (ZOOptions, ZOHeadOptions)
# what a retrieval evaluation never reads besides a classification task's options: it scores the corpus, queries and
# judgements of its own files
NOT_RETRIEVAL_OPTIONS = ("train_file", "eval_file", "columns", "chat_template", "task_name", "data_dir", "data_format",
                         "num_train", "num_eval", "train_set_seed", "head")
BOOSTING_GROUPS = (BoostingOptions, AdaptiveBoostingOptions)

IGNORED = (
    Ignored(("matryoshka_dims",), RetrievalOptions, lambda c: c.trainers_used == {"none"} and c.retrieval_files is None,
            "nothing trains under --trainer none, and only a retrieval evaluation (--beir_dir) scores at each size"),
    Ignored(("truncate_dim",), RetrievalOptions, lambda c: c.retrieval_files is None,
            "only a retrieval evaluation (--beir_dir) embeds cut to a size"),
    Ignored((ClassificationOptions, *NOT_RETRIEVAL_OPTIONS), RetrievalOptions, lambda c: c.retrieval_files is not None,
            "a retrieval evaluation reads the corpus, queries and judgements of --beir_dir (or --corpus_file, "
            "--queries_file, --qrels_file) only"),
    Ignored(TRAINING_GROUPS, MethodOptions, lambda c: c.trainers_used == {"none"},
            "nothing trains under --trainer none (what xgblora eval and xgblora mezo run by default); drop it, or "
            "train with xgblora train"),
    Ignored(ZO_GROUPS, MethodOptions, lambda c: "zo" not in c.trainers_used,
            "a zeroth-order option, unused by --trainer regular (AdamW); pass --trainer zo"),
    Ignored((AdamWOptions, MemoryOptions), MethodOptions, lambda c: c.trainers_used == {"zo"},
            "an AdamW/back-propagation option; --trainer zo runs forward passes only"),
    Ignored(("disable_dropout",), MethodOptions, lambda c: c.trainers_used == {"zo"},
            "--trainer zo's forwards never apply the model's dropout"),
    Ignored(("scale_rewards", "policy_loss", "importance_sampling_level", "multi_objective_aggregation",
             "use_bias_correction_kl"), RLOOOptions, lambda c: c.advantage_estimator == "rloo",
            "a GRPO option; --advantage_estimator rloo takes TRL's RLOOTrainer's advantages and loss (its "
            "--normalize_advantages scales the advantages)"),
    Ignored(("normalize_advantages", "reward_clip_range"), RLOOOptions, lambda c: c.advantage_estimator == "grpo",
            "an RLOO option; pass --advantage_estimator rloo (GRPO scales advantages with --scale_rewards)"),
    Ignored(("max_tool_calling_iterations", "tool_timeout"), ToolOptions,
            lambda c: not c.tools and not c.environment_factory,
            "read only when the policy has tools: pass --tools or --environment_factory"),
    Ignored(("adam_beta1",), ZOOptions, lambda c: c.trainers_used == {"zo"} and c.zo_optimizer == "sgd",
            "--trainer zo with --zo_optimizer sgd keeps no momentum; pass --zo_optimizer momentum or adam"),
    Ignored(("adam_beta2", "adam_epsilon"), ZOOptions, lambda c: c.trainers_used == {"zo"} and c.zo_optimizer != "adam",
            "--trainer zo reads it with --zo_optimizer adam only"),
    Ignored((AdapterOptions, *BOOSTING_GROUPS), MethodOptions, lambda c: c.methods_used == {"ft"},
            "full fine-tuning (--method ft) trains no adapter; pass --method lora or --method xgblora"),
    Ignored(BOOSTING_GROUPS, MethodOptions, lambda c: "xgblora" not in c.methods_used,
            "an XGBLoRA booster option, unused by plain LoRA; pass --method xgblora"),
    Ignored((AdaptiveBoostingOptions,), BoostingOptions, lambda c: not c.xgblora_adaptive,
            "the adaptive merge's option; pass --xgblora_adaptive"),
    Ignored((EmbeddingOptions, ContrastiveOptions, GritOptions), TaskOptions, lambda c: not c.embeds,
            "an embedding option, unused by --objective lm or rerank; pass --objective contrastive or grit"),
    Ignored((GritOptions,), TaskOptions, lambda c: c.objective == "contrastive",
            "a GRIT option, unused by --objective contrastive; pass --objective grit"),
    Ignored((NextTokenOptions,), TaskOptions, lambda c: c.objective in ("contrastive", "rerank"),
            "a next-token training option, unused by --objective contrastive or rerank (pairs are scored, not "
            "generated)"),
    Ignored((ClassificationOptions, "train_as_classification"), TaskOptions, lambda c: c.objective != "lm",
            "a MeZO-task/classification option; an embedding or reranker objective trains on pairs"),
    Ignored((HeadOptions,), TaskOptions, lambda c: c.objective == "rerank",
            "a reranker is a sequence classifier with one output, read as the model's own classification head "
            "reads it (as sentence-transformers' CrossEncoder)"),
    Ignored((RerankOptions,), TaskOptions, lambda c: c.objective != "rerank",
            "a reranker training option, unused by --objective lm, contrastive or grit; pass --objective rerank"),
    Ignored(("rerank_num_negatives",), RerankOptions, lambda c: c.rerank_loss != "mnrl",
            "the in-batch negatives of --rerank_loss mnrl"),
    Ignored(("rerank_weighting_scheme",), RerankOptions, lambda c: c.rerank_loss != "lambda",
            "the weighting scheme of --rerank_loss lambda"),
    Ignored(("rerank_top_k", "always_rerank_positives"), RerankEvalOptions, lambda c: c.reranker is None,
            "an option of the reranking evaluation; pass --reranker"),
)


def groups_of(cls: type) -> tuple[type, ...]:
    """The option groups a command's class inherits, in the order its help shows them."""
    return tuple(group for group in GROUPS if issubclass(cls, group))


def own_options(cls: type) -> list[str]:
    """The fields cls and its bases other than the groups declare themselves (a command's own options), in the
    order they are declared, the most derived class first; an option of one of its groups given another default
    (`redefault`) stays its group's."""
    grouped = {f.name for group in groups_of(cls) for f in dataclasses.fields(group)}
    names = [name for c in cls.__mro__ if dataclasses.is_dataclass(c) and c not in GROUPS
             for name in vars(c).get("__annotations__", {}) if name not in grouped]
    return list(dict.fromkeys(names))


def check_ignored(cfg: Any, defaults: dict[str, Any] | None = None) -> None:
    """Refuse, in one line, an option changed from its default (the command's `defaults`, else the dataclass's) that
    the run would never read under the values of the others (IGNORED)."""
    default_of = {f.name: (defaults or {}).get(f.name, field_default(f)) for f in dataclasses.fields(cfg)}
    for rule in IGNORED:
        names = rule.names(type(cfg))
        if not names or not isinstance(cfg, rule.when) or not rule.applies(cfg):
            continue
        for name in names:
            value = getattr(cfg, name)
            if value != default_of[name]:
                raise UserError(f"--{name} {value!r} does nothing here: {rule.reason}")


# Every command's options class, for the options a YAML config may name at their default though the command lacks
# them (a config.yaml another command wrote)
COMMAND_CLASSES = (Config, EvalConfig, CompareConfig, ChatConfig, GenerateConfig, RFTConfig, GRPOConfig, DPOConfig,
                   KTOConfig, RewardConfig)


def defaults_elsewhere(name: str) -> list[Any]:
    """The defaults the option `name` has in the command classes that declare it (none: no command has it)."""
    return [field_default(f) for cls in COMMAND_CLASSES for f in dataclasses.fields(cls) if f.name == name]
