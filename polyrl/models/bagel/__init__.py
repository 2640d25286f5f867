"""BAGEL (ByteDance-Seed/BAGEL-7B-MoT) text-to-image: `modeling.py` the mixture-of-transformers network,
`autoencoder.py` its FLUX.1 VAE, `policy.py` the DiffusionPolicy and the checkpoint loader (docs/image_models.md)."""

from .policy import BagelPolicy  # noqa: F401  (registers model.name=bagel)
