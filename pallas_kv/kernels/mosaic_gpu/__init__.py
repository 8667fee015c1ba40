"""Mosaic GPU (Hopper and newer) kernels.

  config.py    what the kernel supports, its SMEM layout and fit, the config choice
  tiling.py    KV tiles in SMEM and where their tokens live in GMEM (contiguous or paged)
  pipeline.py  the TMA ring: a producer fills SMEM slots, consumers wait and release them
  decode.py    the split-K GQA decode kernel
  mla.py       the split-K MLA decode kernel; mla_config.py its SMEM layout and config
  backend.py   what `pallas_kv.api` calls
"""
