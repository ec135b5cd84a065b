"""The router: the OpenAI-compatible HTTP API, the pipeline orchestrator, the replicas of
each stage (remote clients of stage servers, found statically or through EndpointSlices).

A router pod runs without torch, vLLM or diffusers: nothing here may import them.
"""
