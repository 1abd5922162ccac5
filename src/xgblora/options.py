"""The options of every command, in small groups of flat, MeZO- and TRL-named flags: each group a frozen dataclass
whose fields carry their help and choices. A command's options class (config.py) inherits the groups it reads, and
its parser shows those only; the rules that span groups live with the command classes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from xgblora.errors import UserError

# The paper's Eq. 7 adds lambda (|A|^2 + |B|^2) to each booster's loss; its value for our models is not in the text
# we could read, so it is a small one that changes little (see README). The booster counts are ours too.
PAPER_NORM_PENALTY = 1e-3
# MeZO's protocol draws 1000 training examples from a task's train split; a user's own data uses every row.
MEZO_NUM_TRAIN = 1000
# ... and generates at most 50 tokens for a generation task's answer (SQuAD, DROP)
MEZO_MAX_NEW_TOKENS = 50
# Boosters per run when neither --xgblora_num_boosters nor --xgblora_steps_per_iteration is given, per preset. plain
# (the default) is the measured best: more boosters on every layer beat the paper's third of the layers at equal
# steps where rank limits and on SmolLM2, and tie on MiniLM SST-2 (BENCHMARKS.md, "XGBLoRA's preset").
PRESET_BOOSTERS = {"paper": 5, "plain": 25}
# ... but a plain booster trains at least this many steps, so a short run has fewer boosters: on a pretrained model
# boosters of 3 to 16 steps trail LoRA r=1, boosters of 50 do not (BENCHMARKS.md, "The booster regime").
MIN_BOOSTER_STEPS = 50
ZO_ESTIMATORS = ("mezo", "fzoo", "svrg", "nspsa", "es")
GGUF_SUFFIX = ".gguf"
# The devices --device names: torch's names of the CPU, a CUDA GPU and Apple's MPS, or auto. Checked by name here,
# where torch is not imported yet; whether this machine has the device is checked where the model is placed.
DEVICE_NAME = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def is_gguf(name_or_path: str) -> bool:
    """Whether a model name names a GGUF file (a local path, or owner/repo/FILE.gguf on the hub)."""
    return name_or_path.lower().endswith(GGUF_SUFFIX)


def check_device_name(name: str) -> None:
    """A one-line UserError for a --device value that names no device (torch's own error is a traceback)."""
    if not DEVICE_NAME.fullmatch(name):
        raise UserError(f"--device {name!r}: choose cpu, cuda, cuda:N (the N-th GPU), mps or auto")


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None, aliases: tuple[str, ...] = ()) -> Any:
    return _field(default, {"help": help, "choices": choices, "aliases": aliases})


def _field(default: Any, meta: Any) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def redefault(group: type, name: str, default: Any) -> Any:
    """The option `name` of `group` (its help, choices and aliases: declared once) with a command's own default."""
    declared = next(f for f in fields(group) if f.name == name)
    return _field(default, declared.metadata)


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
    adapter: str | None = _opt(None, "A PEFT LoRA adapter folder or an xgblora run folder, applied on --model_name; train and rft continue training it (XGBLoRA merges it as booster 1).")
    load_in_4bit: bool = _opt(False, "QLoRA: the base model's linear layers in 4-bit NF4 (bitsandbytes); the adapters stay fp32. Training: --method lora or xgblora.")
    device: str = _opt("auto", "cpu, cuda, cuda:N, mps (Apple silicon), or auto (cuda when available); a device this machine lacks is refused before the model loads.")

    def resolve_gguf_file(self) -> None:
        """Fold --gguf_file into --model_name, a local GGUF file or folder made absolute: the one name config.yaml
        and a trained adapter record, so eval, generate and export find the same base from any directory."""
        if self.gguf_file is not None:  # a local folder's file by its absolute path, a hub repository's as repo/FILE
            folder = Path(self.model_name).expanduser()
            name = str(folder / self.gguf_file) if folder.is_dir() else f"{self.model_name.rstrip('/')}/{self.gguf_file}"
            object.__setattr__(self, "model_name", name)  # frozen: resolved once, while the object is built
            object.__setattr__(self, "gguf_file", None)
        path = Path(self.model_name).expanduser()
        if (is_gguf(self.model_name) and path.is_file()) or path.is_dir():
            object.__setattr__(self, "model_name", str(path.resolve()))

    @property
    def dtype_name(self) -> str:
        """Weight dtype as a torch dtype name."""
        return "float16" if self.load_float16 else "bfloat16" if self.load_bfloat16 else "float32"


@dataclass(frozen=True)
class InputOptions:
    """The rows a run reads: its files, how their columns map, the chat template, the length cut."""

    train_file: str | None = _opt(None, "Custom task: training data: JSON/JSONL, CSV/TSV, parquet, arrow, a save_to_disk folder, or a dataset id.")
    eval_file: str | None = _opt(None, "Your own data: the evaluation rows, in any form --train_file takes. Without it: the rows --num_train N did not draw, or no evaluation.")
    columns: str | None = _opt(None, "Custom task: map your column names to ours, OURS=THEIRS,... (e.g. prompt=question,completion=answer).")
    chat_template: str | None = _opt(None, "A Jinja chat template file, replacing the tokenizer's (conversation rows need one).")
    max_length: int = _opt(2048, "Longest input in tokens; longer inputs are truncated from the left.")


@dataclass(frozen=True)
class TaskOptions:
    """Which task the rows are and how its examples are drawn: MeZO's tasks, custom classification or instruction
    data, or pairs for an embedding objective."""

    task_name: str = _opt("SST2", "SST2, RTE, CB, BoolQ, Copa, WIC, WSC, MultiRC, ReCoRD, SQuAD, DROP, or custom.")
    data_dir: str | None = _opt(None, "Folder with <task>/{train,dev}.jsonl in GLUE/SuperGLUE field names (else HF datasets).")
    data_format: str = _opt("auto", "Custom instruction data: messages (chat turns), prompt_completion (also prompt/response; a conversational prompt/completion is a chat), text (language modelling); auto: from each row's fields.",
                            ("auto", "messages", "prompt_completion", "text"))
    objective: str = _opt("lm", "What the model learns: lm (the task's own loss), contrastive (an embedding model on query/positive pairs), grit (a causal LM that embeds and generates) or rerank (a cross-encoder scoring a (query, passage) pair with one logit, as sentence-transformers' CrossEncoder).",
                          ("lm", "contrastive", "grit", "rerank"))
    num_train: int | None = _opt(None, "Training examples drawn from the train split (demonstrations when --trainer none). Default: every row of your own data; 1000 for MeZO's tasks.")
    num_eval: int | None = _opt(None, "Evaluation examples drawn from the validation split (all when unset).")
    train_set_seed: int = _opt(0, "Seed of the train/dev sampling.")

    @property
    def own_data(self) -> bool:
        """Whether the rows are the user's own (--task_name custom, or pairs for an embedding objective) rather than
        one of MeZO's tasks: their defaults are every row for training and no dev split."""
        return self.task_name.lower() == "custom" or self.objective != "lm"

    @property
    def embeds(self) -> bool:
        """Whether the run trains or scores an embedding model (--objective contrastive or grit)."""
        return self.objective in ("contrastive", "grit")


@dataclass(frozen=True)
class ClassificationOptions:
    """A classification task's prompt and label words, and how candidate scores are calibrated (MeZO's tasks and
    custom classification)."""

    template: str | None = _opt(None, "Custom classification task: prompt template with {field} slots, e.g. '{text} It was'.")
    label_words: str | None = _opt(None, "Custom classification task: comma-separated verbalizers, one per label, in label order.")
    label_names: str | None = _opt(None, "Custom classification task: comma-separated label values as they appear in the file (default 0,1,...).")
    sfc: bool = _opt(False, "Calibrate candidate scores with surface-form competition (SFC).")
    icl_sfc: bool = _opt(False, "SFC with the demonstrations in the calibration prompt.")


@dataclass(frozen=True)
class HeadOptions:
    """What scores the labels, and what a classifier head reads."""

    head: str = _opt("auto", "What scores the labels: lm (candidate tokens), classifier (a new head), mlm (label words at a mask); auto: lm for causal LMs, else mlm with an MLM head, else classifier.",
                     ("auto", "lm", "classifier", "mlm"))
    pooling: str = _opt("auto", "What a classifier head or an embedding pools: cls, mean or last token; auto: the model's sentence-transformers pooling, else cls (embeddings: mean or last).",
                        ("auto", "cls", "mean", "last"))


@dataclass(frozen=True)
class EmbeddingOptions:
    """What an embedding model embeds: the instructions before queries and documents, the pooling of the
    instruction, attention both ways, the Matryoshka sizes (trained, and scored by a retrieval evaluation)."""

    query_instruction: str = _opt("", "Contrastive/GRIT: text put before every query (e.g. 'query: '); with --instruction_format gritlm the task instruction that GritLM's format wraps.")
    doc_instruction: str = _opt("", "Contrastive/GRIT: text put before every document (e.g. 'passage: '); with --instruction_format gritlm wrapped the same way.")
    instruction_format: str = _opt("plain", "Contrastive/GRIT: plain (the instructions as they are) or gritlm (GritLM's format: '<|user|>\\n{instruction}\\n<|embed|>\\n', or '<|embed|>\\n' without an instruction, for queries and documents alike).",
                                   ("plain", "gritlm"))
    include_prompt: bool | None = _opt(None, "Contrastive/GRIT: the instruction's tokens count in the mean pooling (they are always attended to). Default: off for grit, on for contrastive.")
    bidirectional: bool | None = _opt(None, "Contrastive/GRIT with a causal LM: the embedding pass attends both ways (GritLM; checked). Default: on for grit, off for contrastive.")
    matryoshka_dims: str | None = _opt(None, "Contrastive/GRIT: Matryoshka embeddings (sentence-transformers' MatryoshkaLoss): the loss summed over the embeddings cut to each of these sizes, e.g. 384,256,128,64 (each cut normalised anew); a retrieval evaluation (--beir_dir) scores at each size (truncate_dim), and a --reranker reranks the whole embedding's ranking (or --truncate_dim's).")


@dataclass(frozen=True)
class RetrievalOptions:
    """Retrieval evaluation on BEIR-format files (a corpus, queries, relevance judgements), scored as sentence-transformers' InformationRetrievalEvaluator: nDCG@10, MRR@10, MAP@100, accuracy, precision and recall at 1, 3, 5, 10 (and 100)."""

    beir_dir: str | None = _opt(None, "A BEIR-format folder: corpus.jsonl (_id, title, text), queries.jsonl (_id, text) and qrels/test.tsv (query-id, corpus-id, score, after a header line; a score above 0 is relevant); each file can be named apart instead.")
    corpus_file: str | None = _opt(None, "The corpus JSONL (_id, text, optional title) instead of --beir_dir's corpus.jsonl.")
    queries_file: str | None = _opt(None, "The queries JSONL (_id, text) instead of --beir_dir's queries.jsonl.")
    qrels_file: str | None = _opt(None, "The relevance judgements TSV (query-id, corpus-id, score) instead of --beir_dir's qrels/test.tsv (e.g. qrels/dev.tsv).")
    truncate_dim: int | None = _opt(None, "With --beir_dir: embed as sentence-transformers' SentenceTransformer(model, truncate_dim=K) does, every embedding cut to its first K dimensions (a Matryoshka model at one of its sizes); the first stage is scored, and a --reranker reranks its ranking, at that size alone, in place of --matryoshka_dims' sizes (a trained run's own too). Default: the whole embedding.")

    @property
    def retrieval_files(self) -> tuple[Path, Path, Path] | None:
        """The corpus, queries and qrels files of a retrieval evaluation; None when none is named."""
        given = {"corpus_file": self.corpus_file, "queries_file": self.queries_file, "qrels_file": self.qrels_file}
        if self.beir_dir is None and not any(given.values()):
            return None
        if self.beir_dir is None and not all(given.values()):
            missing = ", ".join(f"--{name}" for name, path in given.items() if not path)
            raise UserError(f"a retrieval evaluation reads three files: give --beir_dir DIR, or also {missing}")
        folder = Path(self.beir_dir or ".")
        return (Path(self.corpus_file or folder / "corpus.jsonl"), Path(self.queries_file or folder / "queries.jsonl"),
                Path(self.qrels_file or folder / "qrels" / "test.tsv"))


@dataclass(frozen=True)
class RerankEvalOptions:
    """A second stage for a retrieval evaluation: a cross-encoder reranking the first stage's best documents, scored
    as sentence-transformers' CrossEncoderRerankingEvaluator: MAP, MRR@10 and nDCG@10, before and after."""

    reranker: str | None = _opt(None, "With --beir_dir: a cross-encoder (an xgblora rerank run, a sentence-transformers CrossEncoder folder, a hub id or pkg:) that reranks the first stage's --rerank_top_k documents of each query.")
    rerank_top_k: int = _opt(100, "How many of the first stage's best documents the --reranker reranks per query (sentence-transformers' rerank_k).")
    always_rerank_positives: bool = _opt(True, "The --reranker also ranks the relevant documents the first stage left out of its top k, so its figures can reach 1 (sentence-transformers' default); false: it ranks the first stage's top k alone.")


@dataclass(frozen=True)
class RerankOptions:
    """Training a cross-encoder reranker (--objective rerank): the loss, as sentence-transformers' CrossEncoder
    losses compute it."""

    rerank_loss: str = _opt("bce", "Rerank: bce (BinaryCrossEntropyLoss on each pair's label), mnrl (MultipleNegativesRankingLoss: each query's positive against its hard negatives and --rerank_num_negatives passages of other rows, on 10 x sigmoid(logit)) or lambda (LambdaLoss: each query's passages ranked by their labels).",
                            ("bce", "mnrl", "lambda"))
    rerank_num_negatives: int = _opt(4, "Rerank with mnrl: passages of the batch's other rows scored as each query's negatives, drawn at random (sentence-transformers' num_negatives); -1: all of them.")
    rerank_weighting_scheme: str = _opt("ndcg_loss2pp", "Rerank with lambda: LambdaLoss's weighting scheme: ndcg_loss2pp (NDCGLoss2++, mu 10), ndcg_loss2, ndcg_loss1, lambdarank or none.",
                                        ("ndcg_loss2pp", "ndcg_loss2", "ndcg_loss1", "lambdarank", "none"))


@dataclass(frozen=True)
class SplitOptions:
    """The dev split: drawn from the training rows, read by periodic evaluation and the best checkpoint."""

    num_dev: int | None = _opt(None, "Dev examples drawn from the train split (disjoint from the training ones); none unless given. The dev split is what --evaluation_strategy steps and --load_best_model_at_end read.")
    dev_pool: str = _opt("any", "Which train-split examples the dev set is drawn from: any, or sentences (8+ words ending in . ! or ?, like SST-2's validation split).",
                         ("any", "sentences"))
    eval_split_ratio: float | None = _opt(None, "Your own data: hold out this fraction of --train_file's rows as the dev split (instead of --num_dev N).")


@dataclass(frozen=True)
class SupervisedOptions:
    """Training on a task's examples: the loss on candidates, a new classifier head's start, the final evaluation."""

    only_train_option: bool = _opt(True, "MeZO's tasks on a causal LM: the loss is on the gold candidate's tokens only (false: on every token of prompt and candidate, as MeZO's run.py). Instruction data: see --train_on_prompt.")
    train_as_classification: bool = _opt(False, "Train with cross-entropy over the candidates.")
    head_init: str = _opt("probe", "How a new classifier head starts: probe (a logistic regression fitted by L-BFGS on the frozen model's features of the training examples, seconds) or random.",
                          ("probe", "random"))
    head_probe_l2: float | None = _opt(None, "L2 strength of the --head_init probe's logistic regression (default: chosen by k-fold cross-validation on the training examples from head.PROBE_L2_GRID, 1e-3 to 3e-1, k = head.PROBE_FOLDS = 5).")
    no_eval: bool = _opt(False, "Skip the final evaluation.")


@dataclass(frozen=True)
class ContrastiveOptions:
    """Contrastive and GRIT training of an embedding model: temperature, loss, gradient caching, Matryoshka sizes,
    length-sorted pieces."""

    contrastive_temperature: float | None = _opt(None, "Contrastive/GRIT: softmax temperature of the cosine similarities. Default: 0.02 for grit (GritLM's), 0.05 for contrastive (sentence-transformers' scale 20).")
    contrastive_loss: str = _opt("infonce", "Contrastive: infonce (sentence-transformers' MultipleNegativesRankingLoss) or symmetric (also each positive against all queries: its Symmetric variant).",
                                 ("infonce", "symmetric"))
    learnable_temperature: bool = _opt(False, "Contrastive: learn the temperature (as CLIP does, its log-scale trained by AdamW from --contrastive_temperature).")
    mini_batch_size: int = _opt(0, "Contrastive/GRIT gradient caching (GradCache): embed this many rows at a time, keeping every in-batch negative at one mini-batch's memory; 0: off.")
    matryoshka_weights: str | None = _opt(None, "Contrastive/GRIT: the weight of each --matryoshka_dims size's loss, as many as sizes (default: 1 each).")
    embed_pieces: bool | None = _opt(None, "Contrastive/GRIT without gradient caching: embed in length-sorted pieces, each padded to its own longest row. Default: on for the CPU, off on CUDA.")


@dataclass(frozen=True)
class GritOptions:
    """GRIT's generative loss beside the contrastive one: its instruction rows, the weights of the two losses, its
    batch."""

    grit_train_file: str | None = _opt(None, "GRIT: instruction data for the generative loss, in any form --train_file takes (messages, prompt/completion, text).")
    grit_contrastive_weight: float = _opt(1.0, "GRIT: weight of the contrastive loss.")
    grit_generative_weight: float = _opt(1.0, "GRIT: weight of the generative loss.")
    grit_generative_batch_size: int | None = _opt(None, "GRIT: instruction examples per batch for the generative loss (GritLM's per_device_generative_bs; default: --per_device_train_batch_size, one per pair).")


@dataclass(frozen=True)
class InstructionOptions:
    """Instruction data: which tokens carry loss (in training and in the evaluation loss)."""

    train_on_prompt: bool = _opt(False, "Instruction data: the prompt (user and system turns) carries loss too, not only the answers.")


@dataclass(frozen=True)
class NextTokenOptions:
    """Next-token training: how a batch's loss averages, padding-free batches, logged dev generations."""

    loss_mean: str = _opt("auto", "Loss of a batch: the mean over its target tokens (token) or of each example's mean (example); auto: token for instruction data, example for MeZO's tasks.",
                          ("auto", "token", "example"))
    packing: bool | None = _opt(None, "Padding-free batches: a batch's sequences end to end in one row (causal LMs; checked). Default: on with flash attention, off with sdpa/eager.")
    log_samples: int = _opt(0, "Instruction data: also log N of the dev generations (prompt, prediction, reference) to metrics.jsonl at each evaluation.")


@dataclass(frozen=True)
class MemoryOptions:
    """The memory of a backward pass through a model's own next-token loss: activations recomputed, the LM head
    fused."""

    gradient_checkpointing: bool = _opt(False, "Recompute activations in the backward pass to save memory.")
    use_liger_kernel: bool = _opt(False, "Liger-Kernel's Triton RMSNorm, RoPE and SwiGLU kernels in the model (CUDA only; pip install liger-kernel); the LM head stays xgblora's fused one.")
    activation_offloading: bool = _opt(False, "Keep the activations the backward pass needs in pinned host memory instead of on the GPU, copied back as the backward reaches them (torch's save_on_cpu; CUDA only).")
    fused_lm_head: bool = _opt(True, "Causal LM training by back-propagation: project only the scored positions through the LM head, a chunk of tokens at a time, recomputed in the backward pass, so that no [tokens, vocabulary] logits are held (the same loss; a large vocabulary's logits often set the peak memory). Models that scale or softcap their logits, and --compile, keep the full logits.")


@dataclass(frozen=True)
class MethodOptions:
    """What trains (full fine-tuning, LoRA, XGBLoRA boosters) and what trains it (AdamW, MeZO, nothing)."""

    trainer: str = _opt("regular", "regular (AdamW), zo (MeZO), or none (evaluate only: what `xgblora eval` runs).", ("none", "regular", "zo"))
    method: str = _opt("ft", "What trains: full fine-tuning, LoRA, or XGBLoRA boosters.", ("ft", "lora", "xgblora"))
    lora: bool = _opt(False, "Same as --method lora (MeZO's flag).")
    xgblora: bool = _opt(False, "Same as --method xgblora (the XGBLoRA fork's flag).")


@dataclass(frozen=True)
class AdapterOptions:
    """A LoRA adapter's shape: rank, scaling, dropout, target modules."""

    lora_r: int | None = _opt(None, "Adapter rank (default 8 for LoRA, 1 for XGBLoRA).", aliases=("lora_rank",))
    lora_alpha: float | None = _opt(None, "Adapter scaling numerator, positive: delta = (alpha / r) B A. Default 2r, so alpha / r = 2 at every rank (MeZO's r=8, alpha=16); with --use_rslora 2 sqrt(8), the same scale as LoRA's at r=8.")
    use_rslora: bool = _opt(False, "rsLoRA scaling: delta = (alpha / sqrt(r)) B A.")
    lora_dropout: float = _opt(0.0, "Dropout on the adapter branch's input.")
    lora_target_modules: str | None = _opt(None, "Modules to adapt, as PEFT's target_modules: name suffixes (q_proj,v_proj), all-linear, or a regex over the full name. Default: attention query and value (grpo: every linear layer, unless continuing an --adapter).")


@dataclass(frozen=True)
class BoostingOptions:
    """XGBLoRA's boosters: how many, how long each trains, where it starts, when it merges."""

    xgblora_preset: str = _opt("plain", "XGBLoRA defaults: plain (25 boosters of at least 50 steps, fewer in a shorter run, on every layer, no penalty) or paper (5 boosters on a random third of the layers, a norm penalty); explicit flags win.",
                               ("paper", "plain"))
    xgblora_num_boosters: int | None = _opt(None, "Boosters T in a run: each trains max_steps / T steps (default 25 under the plain preset, fewer where that would leave a booster under 50 steps; 5 under paper; not with --xgblora_steps_per_iteration).")
    xgblora_steps_per_iteration: int | None = _opt(None, "Steps per booster before it is merged and re-initialised (default max_steps / the number of boosters; not with --xgblora_num_boosters).")
    xgblora_layers_per_booster: int | None = _opt(None, "Random subset of layers that carries the booster each iteration (default: a third of them, at least 1, under the paper preset; all under plain).")
    xgblora_shrinkage: float = _opt(1.0, "Merge step size alpha_t: W += alpha_t * delta (the paper's 1).")
    xgblora_norm_penalty: float | None = _opt(None, "lambda in lambda * (|A|^2 + |B|^2) added to the loss (default 1e-3 under the paper preset, 0 under plain).")
    xgblora_restart_schedule: bool = _opt(False, "Run the learning-rate schedule (warm-up and decay) anew for every booster, over its steps.")
    xgblora_init: str | None = _opt(None, "Where each booster starts: gradient-orthogonal (A from the gradient's top singular vectors over --xgblora_init_batches batches, among the input directions no earlier booster of the layer took, so that boosters build rank; the default with a backward pass), gradient (the same without that projection), or random (as LoRA; the default under --trainer zo).", ("gradient", "gradient-orthogonal", "random"))
    xgblora_init_batches: int = _opt(1, "--xgblora_init gradient(-orthogonal): training batches (one forward and backward each, beside the training steps) whose gradient starts each booster.")
    xgblora_adaptive: bool = _opt(False, "The Boosting-LoRA-ZO fork's extension (not the paper's): merge when the loss EMA stops improving, at the latest after --xgblora_adaptive_max_steps.")


@dataclass(frozen=True)
class AdaptiveBoostingOptions:
    """The adaptive merge (--xgblora_adaptive): when a booster stops improving."""

    xgblora_adaptive_max_steps: int | None = _opt(None, "Adaptive merge: most steps one booster trains (default: the steps per booster of the fixed schedule).")
    xgblora_adaptive_patience: int = _opt(50, "Adaptive merge: steps without improvement before merging.")
    xgblora_adaptive_threshold: float = _opt(1e-3, "Adaptive merge: relative improvement of the loss EMA that counts.")
    xgblora_adaptive_ema: float = _opt(0.9, "Adaptive merge: EMA decay of the training loss.")


@dataclass(frozen=True)
class OptimizerOptions:
    """The optimiser's budget and schedule: learning rate, warm-up and decay, batch sizes and steps, weight decay."""

    learning_rate: float = _opt(1e-5, "Peak learning rate.")
    per_device_train_batch_size: int = _opt(8, "Training micro-batch size per device.")
    gradient_accumulation_steps: int = _opt(1, "Micro-batches per optimizer step (AdamW only).")
    max_steps: int = _opt(-1, "Optimizer steps (overrides num_train_epochs when > 0).")
    num_train_epochs: float = _opt(3.0, "Epochs when max_steps is not set.")
    weight_decay: float = _opt(0.0, "Decoupled weight decay (not applied to biases and norms).")
    lr_scheduler_type: str = _opt("constant", "Learning-rate schedule.", ("constant", "linear", "cosine"))
    warmup_steps: int = _opt(0, "Linear warm-up steps.")
    warmup_ratio: float = _opt(0.0, "Warm-up as a fraction of max_steps (used when warmup_steps is 0).")


@dataclass(frozen=True)
class MomentumOptions:
    """AdamW's moment estimates, also those of --zo_optimizer momentum and adam."""

    adam_beta1: float = _opt(0.9, "AdamW beta1.")
    adam_beta2: float = _opt(0.999, "AdamW beta2.")
    adam_epsilon: float = _opt(1e-8, "AdamW epsilon.")


@dataclass(frozen=True)
class AdamWOptions:
    """What AdamW alone reads: gradient clipping and its fused kernel."""

    max_grad_norm: float = _opt(1.0, "Gradient clipping norm (0 turns it off).")
    fused_adamw: bool = _opt(True, "AdamW's fused kernel where all weights sit on one CUDA or CPU device (false: torch's default).")


@dataclass(frozen=True)
class ZOOptions:
    """The zeroth-order trainer (--trainer zo): the estimator, its perturbations and the update it drives."""

    zo_eps: float = _opt(1e-3, "MeZO perturbation size epsilon.")
    zo_dual: bool | None = _opt(None, "ZO with adapters: both perturbed losses of a two-point estimate from one forward over a doubled batch (default: on where it applies: adapters with mezo, nspsa, svrg or es).")
    zo_estimator: str = _opt("mezo", "Zeroth-order gradient estimator: mezo (two-point SPSA), nspsa (n two-point), fzoo (one-sided Rademacher), svrg (MeZO-SVRG), es (evolution strategies).", ZO_ESTIMATORS)
    zo_queries: int | None = _opt(None, "Perturbations per step: nspsa's two-point estimates (default 4), fzoo's one-sided ones (default 8), es's antithetic pairs (default 15: a population of 30) or, under --zo_es_sampling independent, its members (default 30); mezo and svrg use 1.")
    zo_es_sampling: str = _opt("antithetic", "es: the population as n antithetic pairs theta +- eps z_i (antithetic, OpenAI ES's mirrored sampling: 2 x --zo_queries members) or N independent one-sided members theta + eps z_m (independent, as the code of \"Evolution Strategies at Scale\" draws them: --zo_queries members, default 30).", ("antithetic", "independent"))
    zo_es_spread: str = _opt("prompts", "es under torchrun with xgblora grpo --zo_objective reward: every process scores every member on its share of the step's prompts (prompts), or its share of the members on all of the step's prompts (members: per step one all-reduce of the N member losses, N x 4 bytes, and no gather of rewards).", ("prompts", "members"))
    zo_member_batch: int = _opt(1, "es under xgblora grpo --zo_objective reward with adapters: members whose completions one batched generation samples, each row on its own member's perturbed adapter (fewer, fuller forwards; memory for that many times the step's rows); 1: one member at a time.")
    zo_optimizer: str = _opt("sgd", "What the ZO estimate drives: sgd (in place, no state), momentum (torch SGD, --adam_beta1 as momentum), adam (torch AdamW); the last two keep fp32 state as large as the trainable weights.", ("sgd", "momentum", "adam"))
    zo_svrg_period: int = _opt(10, "svrg: steps from one anchor step to the next.")
    zo_svrg_anchor_batches: int = _opt(8, "svrg: training batches the anchor step's large-batch estimate averages (2 forwards each).")
    zo_svrg_anchor_learning_rate: float | None = _opt(None, "svrg: the anchor (large-batch) step's rate, MeZO-SVRG's eta_1 (its script: 1e-3), --learning_rate being the steps between, eta_2 (1e-6); scheduled as --learning_rate is (default: --learning_rate).")
    zo_stochastic_rounding: bool | None = _opt(None, "MeZO full-model update in half precision with stochastic rounding (default on in bf16/fp16).")


@dataclass(frozen=True)
class ZOHeadOptions:
    """How a new classifier head trains under --trainer zo."""

    head_trainer: str = _opt("first-order", "Under --trainer zo, how a new classifier head trains: first-order (AdamW on MeZO's detached features), frozen, or zo (perturbed with the body).",
                             ("first-order", "frozen", "zo"))
    head_learning_rate: float = _opt(1e-3, "AdamW learning rate of a first-order head under --trainer zo (constant).")


@dataclass(frozen=True)
class ComputeOptions:
    """Numerics and the size of gradient-free passes: autocast, TF32, the evaluation batch."""

    bf16: bool | None = _opt(None, "bf16 autocast (default: on for CUDA devices that support it).")
    fp16: bool = _opt(False, "fp16 autocast with loss scaling (CUDA only).")
    tf32: bool = _opt(True, "TF32 matmuls on Ampere or newer GPUs (false: full fp32 matmuls).")
    per_device_eval_batch_size: int = _opt(8, "Evaluation batch size (in (example, candidate) pairs); grpo: completions per gradient-free pass (the old and reference log-probabilities).")


@dataclass(frozen=True)
class BatchOptions:
    """How training batches of examples are formed: length grouping."""

    group_by_length: bool | None = _opt(None, "Batch examples of similar length together (less padding). Default: on for --objective lm, off for contrastive and grit (it would thin out in-batch negatives).")


@dataclass(frozen=True)
class CompileOptions:
    """How the training forward runs: eagerly or through torch.compile."""

    compile: bool = _opt(False, "torch.compile the model for the training forward (AdamW's and MeZO's; sampling and evaluation run eagerly).")


@dataclass(frozen=True)
class RunOptions:
    """Seeds and multi-process waiting."""

    seed: int = _opt(42, "Seed of everything except the train/dev sampling.")
    ddp_timeout: int = _opt(1800, "Multi-process runs: seconds a rank waits for the others in a collective before it stops with an error.")


@dataclass(frozen=True)
class OutputOptions:
    """Where the run writes, and whether it may start over there."""

    output_dir: str = _opt("output", "Where the run writes config.yaml, metrics.jsonl, results.json and checkpoints.")
    overwrite_output_dir: bool = _opt(False, "Start over in an output_dir that holds a run.")


@dataclass(frozen=True)
class ResultFileOptions:
    """MeZO's result file beside results.json."""

    result_file: str | None = _opt(None, "Also copy results.json here, as MeZO's run.py does; 'auto': MeZO's name, result/{TASK}-{MODEL}-...-trainset{SEED}.json (what `xgblora mezo` writes). Never over an existing file.")
    tag: str = _opt("", "Tag in the MeZO-style result file name.")


@dataclass(frozen=True)
class LoopOptions:
    """The training loop: logging, evaluation and checkpoint cadence, resuming, trackers, the NaN policy."""

    logging_steps: int = _opt(10, "Log the training loss every N steps.")
    evaluation_strategy: str = _opt("no", "Evaluate on dev every eval_steps (steps) or never (no).", ("no", "steps"),
                                    aliases=("eval_strategy",))
    eval_steps: int = _opt(500, "Evaluate every N steps.")
    eval_on_start: bool = _opt(False, "Also evaluate before the first step (the dev split, else the --eval_file rows; grpo: the held-out pass@1 before training).")
    save_strategy: str = _opt("steps", "Checkpoint every save_steps (steps) or never (no).", ("no", "steps"))
    save_steps: int = _opt(500, "Checkpoint every N steps.")
    save_total_limit: int | None = _opt(None, "Keep at most this many checkpoints.")
    save_only_model: bool = _opt(False, "Checkpoints hold the trainable weights only (no optimizer state; not resumable exactly).")
    load_best_model_at_end: bool = _opt(False, "Reload the best dev checkpoint at the end.")
    resume_from_checkpoint: str | None = _opt(None, "Checkpoint folder, or 'latest'.")
    report_to: str = _opt("none", "Also log to trackers, comma-separated: tensorboard, wandb, mlflow, trackio (through Accelerate's trackers; their files go to output_dir), or none.")
    nan_policy: str = _opt("stop", "On a NaN/inf loss: stop (keep the last good checkpoint) or skip the step.", ("stop", "skip"))


@dataclass(frozen=True)
class CompletionOptions:
    """How long a generated completion may grow."""

    max_new_tokens: int = _opt(256, "Most tokens per generated completion: a chat reply or a sampled answer (rft; grpo, TRL's max_completion_length and dr_grpo's normaliser), a greedy answer checked by dpo's --verifier, a generation task's answer or an instruction's dev generation (train, eval: MeZO's 50).",
                               aliases=("max_completion_length",))


@dataclass(frozen=True)
class SamplingOptions:
    """How completions are drawn (the sampler of chat, generate, RFT and GRPO; see models/sampler.py)."""

    temperature: float = _opt(0.0, "Sampling temperature; 0 is greedy.")
    top_p: float = _opt(1.0, "Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p.")
    max_batch_tokens: int = _opt(32768, "Memory budget of a generation batch: rows x (longest prompt + max_new_tokens) tokens of KV cache.")


ADVANTAGE_ESTIMATORS = ("grpo", "rloo")


@dataclass(frozen=True)
class RLOOOptions:
    """RLOO (TRL's RLOOTrainer) as grpo's advantage estimator: leave-one-out baselines, the KL in the reward."""

    advantage_estimator: str = _opt("grpo", "grpo (each completion's reward minus its group's mean, scaled by --scale_rewards; the KL to the reference in the loss) or rloo (TRL's RLOOTrainer: the reward minus the mean of the other completions of its group; --beta's KL, sum over tokens of log pi_old - log pi_ref, taken off the reward; the loss per completion, its ratio that of the whole sequence's probabilities).", ADVANTAGE_ESTIMATORS)
    normalize_advantages: bool = _opt(False, "rloo: divide the advantages, centred on their mean over the generation batch, by their std (+ 1e-4) over it.")
    reward_clip_range: list[float] | None = _opt(None, "rloo: clip each completion's total reward to [MIN, MAX] before the KL and the baselines.")


@dataclass(frozen=True)
class ToolOptions:
    """Tools a GRPO policy may call inside its rollouts (TRL's GRPOTrainer tools and environment_factory)."""

    tools: list[str] | None = _opt(None, "Python functions the policy may call, module:function each: described to it by their signature and docstring through the chat template, called when a completion holds a tool call, their results fed back as tool turns that carry no loss.")
    environment_factory: str | None = _opt(None, "module:Class (or a function) making one environment per rollout: its reset(**row) starts the rollout (a string it returns joins the last user turn), its public methods are tools, and its get_reward(), where it has one, is one more reward source.")
    max_tool_calling_iterations: int | None = _opt(None, "Most tool-calling turns per rollout (default: no limit besides --max_completion_length).")
    tool_timeout: float = _opt(10.0, "Seconds a tool call may take; a slower call is a failed call whose result says so, and the rollout goes on.")


# Every group, in the order a command's help shows them.
GROUPS = (ModelOptions, InputOptions, TaskOptions, ClassificationOptions, HeadOptions, EmbeddingOptions,
          RetrievalOptions, RerankEvalOptions, SplitOptions, SupervisedOptions, ContrastiveOptions, GritOptions,
          RerankOptions, InstructionOptions, NextTokenOptions, MemoryOptions, MethodOptions, AdapterOptions,
          BoostingOptions, AdaptiveBoostingOptions, OptimizerOptions, MomentumOptions, AdamWOptions, ZOOptions,
          ZOHeadOptions, ComputeOptions, CompileOptions, BatchOptions, RunOptions, OutputOptions, ResultFileOptions, LoopOptions,
          CompletionOptions, SamplingOptions, RLOOOptions, ToolOptions)
