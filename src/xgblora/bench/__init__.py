"""Throughput, memory and limit-ratio measurements against baselines (`xgblora bench`).

Every headline figure is a ratio of two workloads timed side by side in one process, interleaved (A, B, A, B, ...)
and summarised by medians, so that noise from other processes on the machine hits both sides alike. Peak memory is
measured per workload in a fresh subprocess (RSS is a process-lifetime peak on the CPU).

Modules, one concern each:
    flags      the command's flags, and --quick
    workloads  synthetic data and `Bench`: the models, batches and step functions that are timed
    timing     interleaved timing, medians, device sync, the metrics log's per-record cost
    memory     peak memory per workload, each in its own subprocess
    baselines  HF Trainer + PEFT LoRA training; scoring one (example, candidate) pair per forward
    table      targets, verdicts, the printed table
    machine    the machine, library versions and date written beside every suite's figures
    flops      model FLOPs per token from a config, and MFU against the device's peak
    profile    the profiler summary of a workload's slowest timed step
    train_suite  the train suite: every training-step, evaluation and memory figure (`run`)
    sft, icl, compile, grpo, dpo, embed, gpu  the other suites (SFT, GRPO and DPO vs TRL, in-context evaluation,
               --compile, contrastive steps vs sentence-transformers, the CUDA suite)
    suites     the table of suites and `main` (the command)

Import from the submodules: this package imports nothing, so `xgblora` builds its parser from `flags` without
loading torch, and a memory worker's RSS counts only what its workload uses.
"""
