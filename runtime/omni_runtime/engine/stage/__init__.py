"""Stage runtime: wire types, the client contract, the LLM stage, the replica pool."""
