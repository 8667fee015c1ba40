"""Mosaic GPU (Hopper and newer) kernels.

  config.py    what the kernel supports, its SMEM layout and fit, the config choice
  tiling.py    KV tiles in SMEM and where their tokens live in GMEM (contiguous or paged)
  pipeline.py  the TMA ring: a producer fills SMEM slots, consumers wait and release them
  decode.py    the split-K GQA decode kernel
  backend.py   what `pallas_kv.api` calls
"""
