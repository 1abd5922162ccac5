"""Preference training (DPO and its family): the objectives as TRL computes them, and their forwards."""
