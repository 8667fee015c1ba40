"""Mosaic GPU (Hopper and newer) kernels.

  config.py, mla_config.py  what the GQA / MLA kernel supports, its SMEM layout, its config choice
  tiling.py, pipeline.py    KV tiles and where they live in GMEM; the TMA ring of SMEM slots
  decode.py, mla.py         the split-K GQA / MLA kernels (mla_tiles.py, mla_output.py: MLA's pieces)
  backend.py                what `pallas_kv.api` calls
"""
