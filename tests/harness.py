"""Reusable test harness: random cases, tolerance checks, interpret and lowering helpers.

Kernel tests build cases with `make_case`, run a kernel impl (in interpret mode on the CPU) and
compare with `assert_matches_reference` against the float32 reference on the same inputs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Relative error ||out - ref|| / ||ref|| allowed per input dtype.
TOLERANCE = {
    jnp.dtype(jnp.bfloat16): 1e-2,
    jnp.dtype(jnp.float16): 1e-2,
    jnp.dtype(jnp.float32): 1e-5,
}


def relative_error(out, ref) -> float:
  out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
  ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
  denom = np.linalg.norm(ref)
  return float(np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0))


def assert_matches_reference(out, ref, dtype, *, tolerance: float | None = None, what: str = "out") -> float:
  """Asserts out is NaN-free and within the dtype's relative tolerance of ref; returns the error."""
  out_np = np.asarray(jnp.asarray(out, jnp.float32))
  ref_np = np.asarray(jnp.asarray(ref, jnp.float32))
  assert out_np.shape == ref_np.shape, f"{what}: shape {out_np.shape} != reference {ref_np.shape}"
  assert not np.isnan(out_np).any(), f"{what} has NaN"
  tol = TOLERANCE[jnp.dtype(dtype)] if tolerance is None else tolerance
  err = relative_error(out_np, ref_np)
  assert err < tol, f"{what}: relative error {err:.3e} >= {tol:.0e}"
  return err


def assert_lse_matches(lse, ref_lse, dtype) -> None:
  """LSE: -inf exactly where the reference has no keys, close elsewhere."""
  lse, ref_lse = np.asarray(lse, np.float64), np.asarray(ref_lse, np.float64)
  assert not np.isnan(lse).any(), "lse has NaN"
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  finite = np.isfinite(ref_lse)
  tol = 10 * TOLERANCE[jnp.dtype(dtype)]
  np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=tol, atol=tol)


def check_against_reference(case, out_lse, **options):
  """(out, lse) of a kernel impl vs the float32 reference on the case's float32-upcast inputs."""
  import pallas_kv as pkv
  out, lse = out_lse
  f32 = lambda x: x.astype(jnp.float32)
  ref, ref_lse = pkv.decode_attention_reference(f32(case.q), f32(case.k), f32(case.v), case.lengths,
                                                return_lse=True, **options)
  assert out.dtype == case.q.dtype
  assert_matches_reference(out, ref, case.dtype)
  assert_lse_matches(lse, ref_lse, case.dtype)


@dataclasses.dataclass
class Case:
  """One random decode problem, contiguous and (when page_size is set) the same data paged."""
  q: jax.Array  # [B, S, Hq, D] or [B, Hq, D]
  k: jax.Array  # [B, T, Hkv, D]
  v: jax.Array
  lengths: jax.Array  # int32 [B]
  page_size: int | None = None
  k_pages: jax.Array | None = None  # [P, page_size, Hkv, D]
  v_pages: jax.Array | None = None
  block_tables: jax.Array | None = None  # int32 [B, T // page_size]

  @property
  def dtype(self):
    return self.q.dtype


def random_lengths(rng: np.random.Generator, batch: int, capacity: int, *, include_zero: bool = True):
  """Ragged lengths covering 0, the full capacity and values that are not multiples of a tile."""
  lengths = rng.integers(1, capacity + 1, size=batch)
  specials = [capacity, 0] if include_zero else [capacity]
  for i, value in enumerate(specials[:batch]):
    lengths[-(i + 1)] = value
  return jnp.asarray(lengths, jnp.int32)


def paginate(dense, page_size: int, rng: np.random.Generator, *, spare_pages: int = 3, permutation=None):
  """Scatters dense [B, T, ...] into a shuffled page pool; returns (pages, block_tables, permutation)."""
  b, t = dense.shape[:2]
  if t % page_size:
    raise ValueError(f"capacity {t} is not a multiple of page_size {page_size}")
  per_seq = t // page_size
  num_pages = b * per_seq + spare_pages
  if permutation is None:
    permutation = rng.permutation(num_pages)
  block_tables = jnp.asarray(permutation[: b * per_seq].reshape(b, per_seq), jnp.int32)
  filler = jnp.asarray(rng.standard_normal((num_pages, page_size) + dense.shape[2:]), dense.dtype)
  pages = filler.at[block_tables.reshape(-1)].set(dense.reshape(b * per_seq, page_size, *dense.shape[2:]))
  return pages, block_tables, permutation


def make_case(seed: int, *, batch: int = 3, seq_len: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
              head_dim: int = 32, num_queries: int | None = None, dtype=jnp.float32, page_size: int | None = None,
              lengths=None, kv_dtype=None) -> Case:
  """A random case. num_queries=None gives the single-token form q [B, Hq, D]."""
  rng = np.random.default_rng(seed)
  kv_dtype = dtype if kv_dtype is None else kv_dtype
  s = 1 if num_queries is None else num_queries
  q = jnp.asarray(rng.standard_normal((batch, s, num_heads, head_dim)), dtype)
  if num_queries is None:
    q = q[:, 0]
  def kv():
    x = rng.standard_normal((batch, seq_len, num_kv_heads, head_dim))
    if jnp.issubdtype(kv_dtype, jnp.integer):
      return jnp.asarray(np.clip(np.round(x * 40), -127, 127), kv_dtype)
    return jnp.asarray(x, kv_dtype)
  k, v = kv(), kv()
  if lengths is None:
    lengths = random_lengths(rng, batch, seq_len)
  else:
    lengths = jnp.asarray(lengths, jnp.int32)
  case = Case(q=q, k=k, v=v, lengths=lengths)
  if page_size is not None:
    case.page_size = page_size
    case.k_pages, case.block_tables, perm = paginate(k, page_size, rng)
    case.v_pages, _, _ = paginate(v, page_size, rng, permutation=perm)
  return case


def attend(case: Case, q=None, **options):
  """The public op of the case: `paged_decode_attention` over its pages where it has a page size, else
  `decode_attention` over its contiguous cache; q defaults to the case's."""
  import pallas_kv as pkv
  q = case.q if q is None else q
  if case.page_size is None:
    return pkv.decode_attention(q, case.k, case.v, case.lengths, **options)
  return pkv.paged_decode_attention(q, case.k_pages, case.v_pages, case.block_tables, case.lengths, **options)


def read_page_slots(block_tables, lengths, page_size: int, num_pages: int) -> np.ndarray:
  """[P, page_size] bool: the slots some sequence reads as a valid token (pages may be shared)."""
  tables, lengths = np.asarray(block_tables), np.clip(np.asarray(lengths), 0, None)
  read = np.zeros((num_pages, page_size), bool)
  for b, length in enumerate(lengths):
    t = np.arange(min(int(length), tables.shape[1] * page_size))
    read[tables[b, t // page_size], t % page_size] = True
  return read


def _garbage(dtype, nan: bool):
  if jnp.issubdtype(dtype, jnp.integer):
    return jnp.iinfo(dtype).max if nan else jnp.iinfo(dtype).min
  return jnp.nan if nan else jnp.inf


def poison_unread_slots(case: Case, *, dense: bool = True) -> Case:
  """The case with values no valid output may depend on replaced by garbage: K = inf and V = NaN
  past each sequence's length (contiguous) and in every page slot no sequence reads as a valid
  token (paged: past a length in its last page, pages no live table entry names); table entries
  past a sequence's last page hold -1, the library's unassigned marker (clamped into the pool:
  page 0, some other sequence's). One-byte integer caches cannot hold NaN: there K and V get
  their extreme values. dense=False leaves the contiguous k, v as they are."""
  lengths = np.asarray(case.lengths)
  poisoned = dataclasses.replace(case)
  if dense:
    t = case.k.shape[1]
    past = jnp.asarray(np.arange(t)[None, :] >= lengths[:, None])[:, :, None, None]
    poisoned.k = jnp.where(past, _garbage(case.k.dtype, False), case.k)
    poisoned.v = jnp.where(past, _garbage(case.v.dtype, True), case.v)
  if case.page_size is None:
    return poisoned
  ps, num_pages = case.page_size, case.k_pages.shape[0]
  unread = ~read_page_slots(case.block_tables, lengths, ps, num_pages)
  unread = jnp.asarray(unread.reshape(num_pages, ps, *(1,) * (case.k_pages.ndim - 2)))
  poisoned.k_pages = jnp.where(unread, _garbage(case.k_pages.dtype, False), case.k_pages)
  poisoned.v_pages = jnp.where(unread, _garbage(case.v_pages.dtype, True), case.v_pages)
  tables = np.asarray(case.block_tables).copy()
  for b, length in enumerate(np.clip(lengths, 0, None)):
    tables[b, -(-int(length) // ps):] = -1
  poisoned.block_tables = jnp.asarray(tables, jnp.int32)
  return poisoned


def shape_dtype_structs(*args):
  return [jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a for a in args]


# Pallas Triton lowers to this custom call; jax.export refuses it unless told it is expected.
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"
# The CUDA device lowering assumes on a machine without one (Pallas Triton asks for a device).
LOWERING_DEVICE = jax.sharding.AbstractDevice("NVIDIA H200", 132, "cuda")


def lower_for_cuda(fn, *args):
  """Lowers jit(fn) for CUDA on this (possibly CPU-only) machine and returns the jax.export.Exported.

  Mosaic GPU lowering runs its layout inference here; Pallas Triton lowers to Triton IR (its
  compile to PTX happens only on a GPU). args may be arrays or ShapeDtypeStructs.
  """
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=LOWERING_DEVICE)
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.export.export(jax.jit(fn), platforms=["cuda"],
                             disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)])(
                                 *shape_dtype_structs(*args))


def mosaic_text_for_cuda(monkeypatch, fn, *args, host_callbacks: bool = False) -> str:
  """The one Mosaic GPU kernel of jit(fn)(*args) lowered for CUDA, as text after Mosaic GPU's own lowering (the
  custom call holds it as bytecode): what its instructions are (e.g. how many warpgroup barriers, `bar.sync`).
  host_callbacks: fn holds one after the kernel (a traced kernel's, which writes its trace); that lowers only beside
  a GPU backend, so its error past the kernel is expected here."""
  from jax.experimental.mosaic.gpu import core as mgpu_core
  texts, lower = [], mgpu_core.lower_mgpu_module

  def keep(module, *a, **k):
    lower(module, *a, **k)
    texts.append(str(module))

  monkeypatch.setattr(mgpu_core, "lower_mgpu_module", keep)
  try:
    lower_for_cuda(fn, *args)
  except ValueError as e:
    if not (host_callbacks and texts and "platform" in str(e)):
      raise
  assert len(texts) == 1, f"{len(texts)} Mosaic GPU kernels"
  return texts[0]


def tile_loops(text: str) -> list[list[str]]:
  """The lines of each outermost loop of a lowered Mosaic GPU kernel's text (`mosaic_text_for_cuda`) that issues a
  wgmma: its tile loops."""
  lines, loops, open_loops, depth = text.splitlines(), [], [], 0
  for i, line in enumerate(lines):
    if " = scf.for " in line:
      open_loops.append((i, depth))
    depth += line.count("{") - line.count("}")
    while open_loops and depth <= open_loops[-1][1] and i > open_loops[-1][0]:
      body = lines[open_loops.pop()[0]:i + 1]
      if not open_loops and any("wgmma" in l for l in body):   # outermost loops only: no line counted twice
        loops.append(body)
  return loops


def tile_loop_counts(text: str, ops) -> dict[str, int]:
  """How often each of `ops` (substrings) occurs inside a lowered kernel's tile loops (`tile_loops`)."""
  loops = tile_loops(text)
  return {op: sum(op in line for body in loops for line in body) for op in ops}


def gpu_available() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def tiered(cases, *, every_tier):
  """pytest params of `cases` (tuples of argument values): those in `every_tier` run in every tier; the
  rest are marked slow (make test-slow), so that a tier keeps one representative of each axis."""
  every_tier = set(every_tier)
  missing = every_tier - set(cases)
  assert not missing, f"every_tier names cases that are not in cases: {missing}"
  return [pytest.param(*case, marks=() if case in every_tier else pytest.mark.slow) for case in cases]


def small_mla_layer():
  """A small MLA `DecodeAttention` on the xla impl (hidden 64, 4 heads, latent 32 + rope 8), its params and a
  [2, 5, 64] input."""
  import pallas_kv as pkv   # pylint: disable=import-outside-toplevel
  layer = pkv.DecodeAttention(hidden_size=64, num_heads=4, impl="xla",
                              mla=pkv.MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                                v_head_dim=16))
  return layer, layer.init(jax.random.key(3)), jax.random.normal(jax.random.key(4), (2, 5, 64))
