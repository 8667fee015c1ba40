"""Kernel backends, each in its own folder, over the pieces they share.

  split_k.py         the split-K frame: row packing, tile ranges, split counts, the merge
  online_softmax.py  the masked online-softmax math of a kernel body
  mosaic_gpu/        Hopper and newer (TMA rings, wgmma)
  triton/            portable GPUs (Pallas Triton; droppable in one piece)

Imports point down: a backend imports the shared modules, never the reverse, and nothing here
imports `pallas_kv.api`.
"""
