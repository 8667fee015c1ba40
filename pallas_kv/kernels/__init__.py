"""Kernel backends, each in its own folder, over the pieces they share.

  plan.py            the split plan: split counts, tile ranges, sequence orders (`SplitPlan`)
  frame.py           around a kernel: row packing, the merge, which calls a kernel serves
  online_softmax.py  the masked online-softmax math of a kernel body
  mosaic_gpu/        Hopper and newer (TMA rings, wgmma)
  triton/            portable GPUs (Pallas Triton; droppable in one piece)

Imports point down: a backend imports the shared modules, never the reverse, and nothing here
imports `pallas_kv.api`.
"""
