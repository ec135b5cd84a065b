"""Model families' own torch modules, where no library the stages run has them.

``bagel``: BAGEL's Mixture-of-Transformers (the understanding and generation experts), its
SigLIP ViT, and its FLUX VAE on diffusers' AutoencoderKL. Written from the paper and the
reference implementation's semantics; the reference itself is only a test oracle.
"""
