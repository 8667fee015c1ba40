"""Kernel backends, each in its own folder, over the pieces they share.

  plan.py            split plans: split counts, tile ranges, sequence orders (`SplitPlan`)
  frame.py           around a kernel: row packing, the split merge, which calls a kernel serves
  mosaic_gpu/        Hopper and newer (TMA rings, wgmma)
  triton/            portable GPUs (Pallas Triton; droppable in one piece)

Imports point down: a backend imports the shared modules, never the reverse; none imports `pallas_kv.api`. The
masked online-softmax math of a kernel body is `pallas_kv.online_softmax`, below the kernels, since
`pallas_kv.shared_prefix` merges its passes with it too."""
