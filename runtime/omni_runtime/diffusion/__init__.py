"""The diffusion side of the runtime: a diffusers engine and the stage that serves it."""
