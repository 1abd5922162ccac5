"""Optimizer steps: first-order AdamW (fo) and zeroth-order MeZO (zo)."""
