"""Portable Pallas Triton kernels (Ampere, ROCm and newer), on jax's deprecated Pallas Triton backend.

Every use of that backend lives in this folder so that it can be dropped in one piece.
"""

from pallas_kv.kernels.triton.decode import decode_partials as decode_partials
from pallas_kv.kernels.triton.decode import fits_smem as fits_smem
from pallas_kv.kernels.triton.decode import row_blocking as row_blocking
from pallas_kv.kernels.triton.decode import smem_bytes as smem_bytes
