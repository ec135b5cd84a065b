"""omni_operator: the kopf operator that reconciles OmniPipeline resources."""
