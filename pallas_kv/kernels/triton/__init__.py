"""Portable Pallas Triton kernels (Ampere, ROCm and newer) on jax's deprecated Pallas Triton backend.

Every use of that backend lives in this folder, so that it can be dropped in one piece (the Mosaic GPU ops
then merge their splits in XLA)."""
