"""Optimizer steps, one interface for the loop: first-order AdamW (`fo`), zeroth-order MeZO on seeded perturbations
(`zo`), the estimators beyond it (`zo_estimators`: n-SPSA, FZOO, MeZO-SVRG, ES), and the learning-rate schedule
(`schedule`)."""
