"""Runners: each diffusers pipeline's call conventions, apart from the generic engine.

``base`` is the interface and the default runner (diffusers' plain conventions, and a
pipeline of no family's image-to-image variant); a family whose pipeline has quirks names
its own runner by import path (``DiTRecipe.runner``), one module per family here, imported
only in the stage process that loads the pipeline. Nothing generic imports those modules.
"""
