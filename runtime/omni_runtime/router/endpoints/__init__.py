"""The router's endpoints, one room each (as vLLM's ``entrypoints/openai/<endpoint>/``):
its request models and their checks, its serving, its answers' models and its routes,
from which FastAPI generates the OpenAPI document (``router.openapi``).

    chat         POST /v1/chat/completions
    completions  POST /v1/completions
    tokenize     POST /tokenize, /detokenize (vLLM's)
    images       POST /v1/images/generations, /v1/images/edits
    videos       the Videos API: /v1/videos[/{id}[/content]]
    models       GET /v1/models
    adapters     POST /v1/load_lora_adapter, /v1/unload_lora_adapter (vLLM's)
    probes       GET /health, /livez, /metrics
    bodies       the bodies of one deployment: the rooms' with its family's fields
"""
