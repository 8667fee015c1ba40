"""Mosaic GPU (Hopper and newer) kernels."""

from pallas_kv.kernels.mosaic_gpu.decode import decode_partials as decode_partials
from pallas_kv.kernels.mosaic_gpu.decode import DecodeSmem as DecodeSmem
from pallas_kv.kernels.mosaic_gpu.decode import smem_bytes as smem_bytes
from pallas_kv.kernels.mosaic_gpu.decode import fits_smem as fits_smem
from pallas_kv.kernels.mosaic_gpu.decode import row_blocking as row_blocking
