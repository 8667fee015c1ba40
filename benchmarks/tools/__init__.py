"""Programs and helpers beside the benchmark routines. The diagnostics, each run as
`python -m benchmarks.tools.NAME` (or `python -m benchmarks tools.NAME`): what a kernel launches
and where its time goes (profile_kernel, ncu_summary, ptxas_summary, triton_sass, clocks),
measurement-only kernel variants and probes (kernel_variants, quantized_probe), the error of
one-byte caches and operands (quantized_error, operand_precision). The serving routine's peer
engine, Hugging Face transformers (smollm2_transformers), runs the same way. shards is the scaling
routine's case: a paged cache sharded over a device mesh.
"""
