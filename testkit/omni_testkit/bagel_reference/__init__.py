"""BAGEL's official reference inference, run on CPU in its own environment (harness.py)."""
