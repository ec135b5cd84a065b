"""Diffusion stage: its core proc, proc manager, and the two clients (out-of-process, inline)."""
