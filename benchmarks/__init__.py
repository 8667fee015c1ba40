"""pallas_kv's benchmarks: `python -m benchmarks ROUTINE [flags]` (__main__.py lists the routines).

The shared core (cases, cli, output, peers, timing), one absl program per routine (decode, mla,
step, scaling, vmap, serving, tune), report (RESULTS.md tables from the rows), and under tools/ the
diagnostics, the serving routine's peer engine and the scaling routine's sharded case.
"""

import importlib

try:   # before a routine starts JAX's CPU client: interpreted kernels need its threads (docs/reliability.md)
  from pallas_kv import runtime as _runtime   # noqa: F401  (reserve_interpret_threads, at import)
except ImportError:   # pallas_kv's rows then read n/a (peers.import_pallas_kv)
  pass

# Modules that moved, under their former names for importers not yet updated (tests/test_smollm2.py,
# tests/test_mosaic_gpu.py, tests/test_scaling.py): `from benchmarks import smollm2` still works.
_MOVED = {"smollm2": "benchmarks.serving", "kernel_variants": "benchmarks.tools.kernel_variants",
          "shards": "benchmarks.tools.shards"}


def __getattr__(name: str):
  if name in _MOVED:
    return importlib.import_module(_MOVED[name])
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
