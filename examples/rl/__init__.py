"""Pieces of the RL example: policy model, task, rollout engine, trainer."""
