r"""Instructions per KV tile of the Triton decode kernel, read from its SASS on a machine without a GPU.

  pip install triton==3.9.0      (its compiler, ptxas and nvdisasm; not a dependency of the project)
  python -m benchmarks.tools.triton_sass --kv_dtype=bfloat16,int8,float8_e4m3fn --scales=token
  python -m benchmarks.tools.triton_sass --minimal_loop --kv_dtype=bfloat16,int8
  python -m benchmarks.tools.triton_sass --kv_dtype=int8 [--page_size=64]     # v as created: tokens last

For each cache dtype it lowers `pallas_kv.decode_attention(impl="triton")` for CUDA (jax.export,
as the lowering tests do), keeps the kernel's Triton module, compiles that for sm_90 with the pip
`triton` package (TTIR -> TTGIR -> PTX -> cubin; ptxas runs here), disassembles it and counts the
instructions of each loop by opcode. The kernel's loops are its tile loops: the first printed is
the unmasked steady state, the masked ones carry extra compares and selects.

How to read it: one loop iteration is one KV tile of one program, per warp. With 4 warps and 4
schedulers per SM, a program issues about (instructions per iteration) cycles per tile. At the
H200's read rate (~16.8 bytes per SM cycle) a 64-token bf16 tile (K and V, 32 KB) lasts ~1,950 SM
cycles, and a one-byte tile at the 0.55x target ~1,070, shared by the programs on the SM.

`--minimal_loop` compiles instead a minimal decode loop of its own (one program: 16 rows, D 128,
online softmax, no scales or masks) over a one-byte cache in the variants that RESULTS.md's
sixth set compares: V laid out [T, D], or [D, T] (tokens contiguous, as `v_tokens_last=True`
stores it), and int8 widened to its value or to value + 1152 (the widening's subtraction left
out; the kernel tried that with the offset taken off after the products: no gain, eighth set).

The pip Triton is not the one built into jaxlib, which compiles the kernel on the GPU: their
passes are close, not identical, so the counts guide a change; the GPU measures it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import re
import subprocess
import tempfile
from collections.abc import Sequence

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

import pallas_kv as pkv

FLAGS = flags.FLAGS
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128

_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*\.(L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\s+(?:`\()?\.?(L_x_\d+)")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def define_flags() -> None:
  flags.DEFINE_list("kv_dtype", ["bfloat16", "int8"], "cache dtypes (bf16 queries; fp16 for one-byte caches)")
  flags.DEFINE_enum("scales", "token", ["none", "head", "token"], "one-byte caches: the scale kind")
  flags.DEFINE_integer("batch", 128, "batch")
  flags.DEFINE_integer("seq_len", 4096, "tokens per sequence")
  flags.DEFINE_integer("block_kv", 64, "TritonConfig.block_kv")
  flags.DEFINE_integer("num_stages", 3, "TritonConfig.num_stages")
  flags.DEFINE_integer("num_warps", 4, "TritonConfig.num_warps")
  flags.DEFINE_bool("minimal_loop", False, "count the minimal loop's variants instead of the kernel")
  flags.DEFINE_bool("v_tokens_last", None, "the kernel with v stored [B, Hkv, D, T] (decode_attention's option); "
                    "unset: the layout a cache of each dtype is created in (one-byte: tokens last)")
  flags.DEFINE_integer("page_size", None, "a paged cache of this page size (default: contiguous)")


# Memory opcodes keep their width: `LDS.U8` (one byte per load) is not `LDS.128`.
_KEEP_MODIFIERS = ("LDS", "STS", "LDSM", "LDG", "STG")


def _opcode(instruction: str) -> str:
  token = _PREDICATE.sub("", instruction).split()[0]
  base = token.split(".")[0]
  return token if base in _KEEP_MODIFIERS else base


def loop_counts(sass: str) -> list[tuple[int, collections.Counter]]:
  """Per loop of a disassembly (a backward branch to a label; not the one-instruction trap loop at
  the end), its instruction count and the count per opcode (predicates dropped; modifiers dropped
  except on loads and stores: `@P0 IMAD.WIDE` counts as IMAD, `LDS.U8` as itself)."""
  labels, instructions = {}, []
  for line in sass.splitlines():
    if label := _LABEL.match(line):
      labels[label.group(1)] = len(instructions)
    elif instruction := _SASS_LINE.match(line):
      instructions.append(instruction.group(1))
  loops = []
  for end, instruction in enumerate(instructions):
    branch = _BRANCH.search(instruction)
    if branch and labels.get(branch.group(1), end) < end:
      body = instructions[labels[branch.group(1)]:end + 1]
      loops.append((len(body), collections.Counter(_opcode(x) for x in body)))
  return loops


@contextlib.contextmanager
def _captured_triton_modules():
  """While open, collects the text of every Triton module that Pallas lowers (a jax internal)."""
  from jax._src.pallas.triton import pallas_call_registration as registration  # pylint: disable=g-import-not-at-top
  original = registration.lowering.lower_jaxpr_to_triton_module
  modules = []

  def capture(*args, **kwargs):
    result = original(*args, **kwargs)
    modules.append(result.module.operation.get_asm())
    return result

  registration.lowering.lower_jaxpr_to_triton_module = capture
  try:
    yield modules
  finally:
    registration.lowering.lower_jaxpr_to_triton_module = original


def kernel_ttir(kv_dtype, *, scales: str, batch: int, seq_len: int, config: pkv.TritonConfig,
                v_tokens_last: bool = False, page_size: int | None = None) -> str:
  """The Triton module (TTIR text) of the decode kernel of one case (paged given page_size),
  lowered for CUDA here."""
  kv_dtype = jnp.dtype(kv_dtype)
  one_byte = kv_dtype.itemsize == 1
  q = jax.ShapeDtypeStruct((batch, HEADS, HEAD_DIM), jnp.float16 if one_byte else kv_dtype)
  # The cache's leading dims: [B, T] dense, [P, page_size] paged (a page per page_size tokens).
  lead = (batch, seq_len) if page_size is None else (batch * seq_len // page_size, page_size)
  kv = jax.ShapeDtypeStruct((*lead, KV_HEADS, HEAD_DIM), kv_dtype)
  v = jax.ShapeDtypeStruct((lead[0], KV_HEADS, HEAD_DIM, lead[1]), kv_dtype) if v_tokens_last else kv
  lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
  if page_size is None:
    op, args = pkv.decode_attention, [q, kv, v, lengths]
  else:
    tables = jax.ShapeDtypeStruct((batch, seq_len // page_size), jnp.int32)
    op, args = pkv.paged_decode_attention, [q, kv, v, tables, lengths]
  call = functools.partial(op, impl="triton", config=config, v_tokens_last=v_tokens_last)
  if one_byte and scales != "none":
    shape = (*lead, KV_HEADS) if scales == "token" else (KV_HEADS,)
    args += [jax.ShapeDtypeStruct(shape, jnp.float32)] * 2
    call = functools.partial(lambda f, *a: f(*a[:-2], k_scale=a[-2], v_scale=a[-1]), call)
  return _lower_triton_module(call, *args)   # the decode kernel (a split call's merge kernel comes second)


def _lower_triton_module(call, *args) -> str:
  """The first Triton module that lowering `call(*args)` for CUDA produces, as TTIR text."""
  # Lowering for CUDA on a machine without one: an abstract H200 (Pallas Triton asks for a device).
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice("NVIDIA H200", 132, "cuda"))
  with _captured_triton_modules() as modules, jax.sharding.use_abstract_mesh(mesh):
    jax.export.export(jax.jit(call), platforms=["cuda"],
                      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
  if not modules:
    raise RuntimeError("no Triton module was lowered")
  return modules[0]


# int8 widened to value + 1152 (the kernel's int8 widening without its subtraction), for the
# minimal loop's variant: the kernel tried this with the offset taken off after the products and
# measured no gain (RESULTS.md, eighth set).
INT8_WITH_OFFSET_PTX = """{
      .reg .b32 t, m;
      xor.b32 t, $2, 0x80808080;
      mov.b32 m, 0x64646464;
      prmt.b32 $0, t, m, 0x5140;
      prmt.b32 $1, t, m, 0x7362;
    }"""


def minimal_loop_ttir(kv_dtype, *, v_tokens_contiguous: bool, keep_offset: bool, block_kv: int, num_stages: int,
                      num_warps: int, rows: int = 16, seq_len: int = 4096) -> str:
  """The Triton module of a minimal decode loop (module doc), lowered for CUDA here."""
  from jax import lax  # pylint: disable=g-import-not-at-top
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import triton as pltr  # pylint: disable=g-import-not-at-top
  from pallas_kv.kernels.triton import tiles as triton_tiles  # pylint: disable=g-import-not-at-top
  kv_dtype = jnp.dtype(kv_dtype)

  def widen(x):
    if x.dtype == jnp.float16:
      return x
    ptx = INT8_WITH_OFFSET_PTX if keep_offset else triton_tiles.WIDEN_PTX[kv_dtype]
    [out] = pltr.elementwise_inline_asm(ptx, args=[x], constraints="=r,=r,r", pack=4,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float16)])
    return out

  def kernel(q_ref, k_ref, v_ref, o_ref):
    q = q_ref[...]

    def step(i, carry):
      acc, m, l = carry
      k = widen(pltr.load(k_ref.at[pl.ds(i * block_kv, block_kv), :]))                 # [bkv, D]
      s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
      m_new = jnp.maximum(m, s.max(axis=1))
      p, alpha = jnp.exp2(s - m_new[:, None]), jnp.exp2(m - m_new)
      if v_tokens_contiguous:
        v = widen(pltr.load(v_ref.at[:, pl.ds(i * block_kv, block_kv)]))                # [D, bkv]
        contract = (((1,), (1,)), ((), ()))
      else:
        v = widen(pltr.load(v_ref.at[pl.ds(i * block_kv, block_kv), :]))                # [bkv, D]
        contract = (((1,), (0,)), ((), ()))
      pv = lax.dot_general(p.astype(jnp.float16), v, contract, preferred_element_type=jnp.float32)
      return acc * alpha[:, None] + pv, m_new, l * alpha + p.sum(axis=1)

    init = (jnp.zeros((rows, HEAD_DIM), jnp.float32), jnp.full((rows,), -jnp.inf), jnp.zeros((rows,)))
    acc, _, l = lax.fori_loop(0, seq_len // block_kv, step, init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)

  q = jax.ShapeDtypeStruct((rows, HEAD_DIM), jnp.float16)
  k = jax.ShapeDtypeStruct((seq_len, HEAD_DIM), kv_dtype)
  v = jax.ShapeDtypeStruct((HEAD_DIM, seq_len) if v_tokens_contiguous else (seq_len, HEAD_DIM), kv_dtype)
  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((rows, HEAD_DIM), jnp.float16),
                        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages))
  return _lower_triton_module(call, q, k, v)


def compile_sass(ttir: str, *, num_warps: int, num_stages: int) -> tuple[str, str]:
  """(SASS text, ptxas resource line) of a TTIR module compiled for sm_90 with the pip triton."""
  try:
    import triton  # pylint: disable=g-import-not-at-top
    from triton.backends.compiler import GPUTarget  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise RuntimeError(f"needs the pip `triton` package (pip install triton==3.9.0): {e}") from None
  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
  tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
  with tempfile.TemporaryDirectory() as directory:
    source = os.path.join(directory, "kernel.ttir")
    with open(source, "w") as f:
      f.write(ttir)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages, "num_ctas": 1})
    cubin = os.path.join(directory, "kernel.cubin")
    with open(cubin, "wb") as f:
      f.write(kernel.asm["cubin"])
    sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", cubin], check=True, capture_output=True,
                          text=True).stdout
    usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", cubin], check=True, capture_output=True,
                           text=True).stdout
  resources = next((line.strip() for line in usage.splitlines() if "REG:" in line), "")
  return sass, resources


def _print_loops(title: str, sass: str, resources: str) -> None:
  registers = re.search(r"REG:(\d+)", resources)
  print(f"== {title}, {registers.group(1) if registers else '?'} registers per thread")
  for size, opcodes in loop_counts(sass):
    print(f"  loop of {size} instructions: " + ", ".join(f"{op} {n}" for op, n in opcodes.most_common(16)))


def minimal_loop_main() -> None:
  """The minimal loop's variants, for each cache dtype (bf16 runs as float16)."""
  for kv_dtype in FLAGS.kv_dtype:
    dtype = jnp.dtype(jnp.float16 if jnp.dtype(kv_dtype).itemsize == 2 else kv_dtype)
    offsets = (False, True) if dtype == jnp.int8 else (False,)
    for v_tokens_contiguous in (False, True):
      for keep_offset in offsets:
        ttir = minimal_loop_ttir(dtype, v_tokens_contiguous=v_tokens_contiguous, keep_offset=keep_offset,
                                 block_kv=FLAGS.block_kv, num_stages=FLAGS.num_stages, num_warps=FLAGS.num_warps)
        sass, resources = compile_sass(ttir, num_warps=FLAGS.num_warps, num_stages=FLAGS.num_stages)
        _print_loops(f"minimal loop, {dtype.name}, V {'[D, T]' if v_tokens_contiguous else '[T, D]'}"
                     f"{', widened with its offset' if keep_offset else ''}", sass, resources)


def main(argv: Sequence[str]) -> None:
  del argv
  if FLAGS.minimal_loop:
    minimal_loop_main()
    return
  config = pkv.TritonConfig(block_kv=FLAGS.block_kv, num_stages=FLAGS.num_stages, num_warps=FLAGS.num_warps,
                            num_splits=1)
  for kv_dtype in FLAGS.kv_dtype:
    tokens_last = FLAGS.v_tokens_last
    if tokens_last is None:
      tokens_last = pkv.cache.default_v_tokens_last(kv_dtype)
    ttir = kernel_ttir(kv_dtype, scales=FLAGS.scales, batch=FLAGS.batch, seq_len=FLAGS.seq_len, config=config,
                       v_tokens_last=tokens_last, page_size=FLAGS.page_size)
    sass, resources = compile_sass(ttir, num_warps=FLAGS.num_warps, num_stages=FLAGS.num_stages)
    _print_loops(f"{kv_dtype} (scales {FLAGS.scales if jnp.dtype(kv_dtype).itemsize == 1 else '-'}), "
                 f"{config.block_kv}-token tiles, {config.num_stages} stages, {config.num_warps} warps"
                 f"{', v tokens last' if tokens_last else ''}{f', page {FLAGS.page_size}' if FLAGS.page_size else ''}",
                 sass, resources)


if __name__ == "__main__":
  define_flags()
  app.run(main)
