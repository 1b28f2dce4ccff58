"""Activation checkpointing: per-block profiles (:mod:`.profile`), the recompute planner (exact DP
over blocks, every-k and sqrt(n) baselines: :mod:`.planner`) and block cover (:mod:`.cover`).
"""
