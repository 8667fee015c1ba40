"""Portable Pallas Triton kernels (Ampere, ROCm and newer), on jax's deprecated Pallas Triton backend.

Every use of that backend lives in this folder so that it can be dropped in one piece.

  config.py    what the kernel supports, its SMEM estimate, the config choice
  decode.py    the split-K GQA decode kernel
  merge.py     the split merge in one launch (also used by the mosaic_gpu ops; without this
               folder they merge in XLA)
  backend.py   what `pallas_kv.api` calls
"""
