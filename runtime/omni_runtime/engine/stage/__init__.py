"""The seed's stage layer: wire types, the client contract, the LLM stage, the replica pool."""
