import atexit
import os
import shutil
import sys
import tempfile

# The suite compiles thousands of small XLA programs and runs most of them once: without LLVM's optimizations
# they compile in about a third less time (the SmolLM2 tests, which run theirs many times, take twice as long;
# the suite as a whole less). Set before JAX starts its backends; a level the environment names is kept.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

import harness  # noqa: E402
from pallas_kv import runtime  # noqa: E402

# Interpret-mode kernels run JAX computations inside host callbacks; with asynchronous CPU dispatch
# a following call can hold the CPU client's threads and deadlock (docs/reliability.md, "Interpret mode"). Tests
# enter interpret mode after the CPU client started, too late for the switch to turn it off itself.
assert runtime.synchronous_cpu_dispatch(), "a JAX computation ran before the conftest"

# An interpreted Mosaic GPU kernel compiles the program of each simulated warpgroup afresh for every
# grid point of every call (jax's thread map lowers and compiles each time); jax's persistent cache
# turns all but the first of those compiles into reads: about a third off each interpreted call
# (docs/reliability.md). A fresh directory per test process, unless the environment names one.
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
  _compilation_cache = tempfile.mkdtemp(prefix="pallas_kv_test_jax_cache_")
  atexit.register(shutil.rmtree, _compilation_cache, ignore_errors=True)
  jax.config.update("jax_compilation_cache_dir", _compilation_cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_collection_modifyitems(config, items):
  if harness.gpu_available():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU: none is present on this machine")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_mosaic_gpu_interpreter():
  """jax's Mosaic GPU interpreter keeps one process-wide simulated memory; a kernel whose interpretation ended
  without its clean-up leaves it behind, and the next kernel reuses its buffers by key whatever their shapes
  (docs/reliability.md). Each test starts from none."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call   # the reset has no public name
  interpret_pallas_call.reset_gpu_interpret_mode_state()
  yield


@pytest.fixture
def mosaic_interpret():
  """The `interpret=` value that runs a Mosaic GPU kernel in interpret mode on the CPU."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  return plgpu.InterpretGPUParams()


@pytest.fixture
def triton_interpret():
  """The `interpret=` value that runs a Pallas Triton kernel on the CPU."""
  return True


@pytest.fixture
def interpret_mode():
  """Runs the library's kernel impls in interpret mode for the duration of a test."""
  import pallas_kv
  with pallas_kv.interpret():
    yield
