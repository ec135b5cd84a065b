"""omni_runtime: the data plane of omni-operator (stage processes, clients, pool, router)."""
