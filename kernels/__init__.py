"""Triton kernels, each with a torch reference. Installed as ``lightning_scale.kernels``."""
