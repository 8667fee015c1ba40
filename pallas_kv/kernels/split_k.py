"""The split-K frame both kernel backends share.

A kernel computes, per (sequence, kv head, split), the softmax-normalised partial output and LSE
of its slice of the KV tiles; this module does everything around that:

  rows        kernels see, per (batch, kv head), R = S * G packed query rows: row r = s * G + g
              is new token s of q head kv_head * G + g, so every q head sharing a KV head is
              served by one program (KV is read once per group);
  tile range  which tiles each split of a sequence streams (`split_tile_range`);
  split count how many splits fill the GPU (`choose_num_splits`);
  merge       combining the splits' partials (`merge_splits`), unless the kernel merges them in
              its own launch (`run(merged=True)`, `active_splits`);
  calls       which calls a split-K GQA kernel serves at all (`unsupported_reason`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp

from pallas_kv import runtime
from pallas_kv import tuned
from pallas_kv import validation
from pallas_kv.config import DecodeConfig

KV_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# One-byte caches the kernels dequantize after the load (k_scale / v_scale).
QUANTIZED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
MAX_GROUP = 16
# A split shorter than this many tiles spends more on its prologue and the merge than it saves.
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 64
# The balanced plan cuts a batch into about this many waves of work items (the SMs' block
# scheduler evens out the last one), and assumes a ragged batch fills at least half its capacity
# when it sizes the grid.
BALANCE_WAVES = 4
# ... but a batch of near-equal lengths (longest at most this times the mean) that fills a wave of
# programs unsplit stays unsplit: its programs already end together, and cutting them only adds
# programs, merges and short remainders (measured on the H200, MLA B128 T8192: 655 us unsplit,
# 702 us cut into 63 + 63 + 2 tiles; benchmarks/RESULTS.md, ninth set). The grid still holds the
# empty splits, which launch and join the merge (and then also loaded q and wrote empty partials):
# 663 us against 579 for the per-sequence plan at that row (tenth set), so the balanced plan is
# for ragged batches.
NEAR_EQUAL_LENGTHS = 1.25


def cdiv(a, b):
  """Ceiling division of ints (or traced int arrays)."""
  return -(-a // b)


def round_up(a: int, b: int) -> int:
  return cdiv(a, b) * b


# ---------------------------------------------------------------- which calls, how many splits

def unsupported_reason(op: str, problem, options, dtypes, *, backend: str, head_dims) -> str | None:
  """Why a split-K GQA backend cannot serve the call (MLA, other caches), or None."""
  _, kv_dtype = dtypes
  kv_dtype = jnp.dtype(kv_dtype)
  if op == "mla":
    return f"MLA is not implemented on the {backend} backend"
  if kv_dtype not in KV_DTYPES + QUANTIZED_DTYPES:
    return (f"the cache dtype {kv_dtype.name} is not supported "
            f"({', '.join(d.name for d in KV_DTYPES + QUANTIZED_DTYPES)})")
  if kv_dtype in KV_DTYPES and options.quantized:
    return f"k_scale / v_scale on a {kv_dtype.name} cache are not supported (they dequantize int8 / fp8 caches)"
  if problem.head_dim not in head_dims:
    return f"head_dim {problem.head_dim} is not one of {tuple(head_dims)}"
  if problem.group_size > MAX_GROUP:
    return f"{problem.group_size} q heads per kv head is over the supported {MAX_GROUP}"
  return None


def choose_num_splits(*, batch: int, num_kv_heads: int, row_blocks: int, capacity: int, block_kv: int,
                      num_sms: int, programs_per_sm: int = 1) -> int:
  """Splits per sequence so that the grid fills the GPU in about one wave.

  No split when batch x kv heads already fill it, or when the context is short.
  """
  programs = batch * num_kv_heads * row_blocks
  slots = num_sms * programs_per_sm
  if programs >= slots:
    return 1
  by_occupancy = slots // programs
  by_length = max(1, cdiv(capacity, block_kv) // MIN_TILES_PER_SPLIT)
  return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def resolve_config(problem, config: DecodeConfig | None, *, backend: str, heuristic: Callable, row_blocks: int,
                   programs_per_sm: int = 1, dtype, num_sms: int | None, device_kind: str | None) -> DecodeConfig:
  """Explicit config, else the tuned one of `backend` for this device kind, else
  heuristic(problem, dtype=dtype); a split count left as None is filled in so that the grid of
  row_blocks programs per (sequence, kv head) fills the GPU (times kv_groups: a program then
  serves that many splits)."""
  if config is None:
    config = tuned.tuned_config(backend, problem, dtype, device_kind)
  if config is None:
    config = heuristic(problem, dtype=dtype)
  if config.num_splits is None:
    choose = {"balanced": choose_balanced_splits, "stream_k": choose_stream_k_programs}.get(config.split_plan,
                                                                                          choose_num_splits)
    splits = choose(batch=problem.batch, num_kv_heads=problem.num_kv_heads, row_blocks=row_blocks,
                    capacity=problem.capacity, block_kv=config.block_kv, num_sms=num_sms or runtime.num_sms(),
                    programs_per_sm=programs_per_sm)
    config = dataclasses.replace(config, num_splits=splits * config.kv_groups)
  return config


# ---------------------------------------------------------------- the balanced split plan

def balanced_chunks(*, num_kv_heads: int, row_blocks: int, num_sms: int, programs_per_sm: int = 1) -> int:
  """Work items (sequence, split) the balanced plan aims for per (kv head, row block): about
  BALANCE_WAVES waves of programs over the whole grid."""
  return max(1, cdiv(BALANCE_WAVES * num_sms * programs_per_sm, num_kv_heads * row_blocks))


def choose_balanced_splits(*, batch: int, num_kv_heads: int, row_blocks: int, capacity: int, block_kv: int,
                           num_sms: int, programs_per_sm: int = 1) -> int:
  """The most splits a sequence may take under the balanced plan (the grid's split extent).

  A batch whose sequences alone make BALANCE_WAVES waves needs no splits. Otherwise a sequence
  may take up to twice its even share of the work items, so a batch that fills at least half its
  capacity is cut evenly; emptier ones get longer splits (`balanced_tiles_per_split`).
  """
  chunks = balanced_chunks(num_kv_heads=num_kv_heads, row_blocks=row_blocks, num_sms=num_sms,
                           programs_per_sm=programs_per_sm)
  if batch >= chunks:
    return 1
  by_length = max(1, cdiv(capacity, block_kv) // MIN_TILES_PER_SPLIT)
  return max(1, min(cdiv(2 * chunks, batch), by_length, MAX_SPLITS))


def balanced_tiles_per_split(lengths, *, block_kv: int, num_queries: int, num_splits: int, window: int | None,
                             chunks: int):
  """The balanced plan of one call: int32 [1], the tiles of every split of every sequence.

  About `chunks` splits over the batch's visible tiles, never more than num_splits for one
  sequence, never fewer than MIN_TILES_PER_SPLIT tiles (a split that short costs more than it
  saves); one split per sequence when the lengths are near-equal and the batch alone fills a wave
  (NEAR_EQUAL_LENGTHS). `split_tile_range(..., tiles_per_split=)` then cuts each sequence with
  it; a sequence needing fewer splits leaves the rest empty.
  """
  first_tile, end_tile = visible_tiles(lengths, block_kv=block_kv, num_queries=num_queries, window=window)
  tiles = jnp.maximum(end_tile - first_tile, 0)
  longest, total = jnp.max(tiles), jnp.sum(tiles)
  per_split = jnp.maximum(cdiv(total, chunks), cdiv(longest, num_splits))
  batch = lengths.shape[0]
  if batch * BALANCE_WAVES >= chunks:   # the sequences alone make a wave of programs
    near_equal = longest * batch <= NEAR_EQUAL_LENGTHS * total
    per_split = jnp.where(near_equal, jnp.maximum(longest, per_split), per_split)
  return jnp.maximum(per_split, MIN_TILES_PER_SPLIT).astype(jnp.int32).reshape(1)


def visible_tiles(length, *, block_kv: int, num_queries: int, window: int | None):
  """(first tile, end tile) of a sequence: the tiles that hold visible keys."""
  first_key = 0 if window is None else jnp.maximum(length - num_queries + 1 - window, 0)
  return first_key // block_kv, (length + block_kv - 1) // block_kv


def _split_tiles(length, *, block_kv: int, num_queries: int, num_splits: int, window: int | None,
                 tiles_per_split=None):
  """(first tile, end tile, tiles per split) of a sequence: its own equal shares, or the
  balanced plan's `tiles_per_split`."""
  first_tile, end_tile = visible_tiles(length, block_kv=block_kv, num_queries=num_queries, window=window)
  if tiles_per_split is None:
    tiles_per_split = (jnp.maximum(end_tile - first_tile, 0) + num_splits - 1) // num_splits
  return first_tile, end_tile, tiles_per_split


def split_tile_range(length, split, *, block_kv: int, num_queries: int, num_splits: int, window: int | None,
                     tiles_per_split=None):
  """Tiles [t0, t1) of split `split` of a sequence of `length` tokens, and the sub-range [a, c)
  whose tiles every new token sees whole (no masking needed).

  New token s (0 <= s < S) sits at p = L - S + s and sees keys t <= p, t > p - window. Every
  split gets an equal share of the tiles that hold visible keys (earlier splits never fewer than
  later ones), so a sequence's partials depend only on its own length and num_splits; tiles
  before the window or past the length belong to no split and are never loaded. With
  `tiles_per_split` (the balanced plan, a runtime scalar) every split takes that many tiles
  instead, and the splits past the sequence's last tile are empty.
  """
  first_tile, end_tile, per_split = _split_tiles(length, block_kv=block_kv, num_queries=num_queries,
                                                 num_splits=num_splits, window=window,
                                                 tiles_per_split=tiles_per_split)
  t0 = jnp.minimum(first_tile + split * per_split, end_tile)
  t1 = jnp.minimum(t0 + per_split, end_tile)
  a, c = unmasked_tiles(length, t0, t1, block_kv=block_kv, num_queries=num_queries, window=window)
  return t0, t1, a, c


def unmasked_tiles(length, t0, t1, *, block_kv: int, num_queries: int, window: int | None):
  """The sub-range [a, c) of tiles [t0, t1) that every new token sees whole (no masking needed):
  keys <= L - S (the first token's position) and, with a window, keys >= L - window (the last
  token's window start)."""
  full_hi = jnp.maximum(length - num_queries + 1, 0) // block_kv
  full_lo = 0 if window is None else (jnp.maximum(length - window, 0) + block_kv - 1) // block_kv
  a = jnp.clip(full_lo, t0, t1)
  c = jnp.clip(full_hi, a, t1)
  return a, c


def active_splits(length, *, block_kv: int, num_queries: int, num_splits: int, window: int | None,
                  tiles_per_split=None):
  """How many splits of a sequence get tiles from `split_tile_range`: splits 0 .. n-1 do, the
  rest are empty (0 for a sequence with no visible key)."""
  first_tile, end_tile, per_split = _split_tiles(length, block_kv=block_kv, num_queries=num_queries,
                                                 num_splits=num_splits, window=window,
                                                 tiles_per_split=tiles_per_split)
  num_tiles = jnp.maximum(end_tile - first_tile, 0)
  return jnp.where(num_tiles > 0, (num_tiles + per_split - 1) // jnp.maximum(per_split, 1), 0)


def check_tiles_per_split(tiles_per_split, config: DecodeConfig) -> bool:
  """Whether a kernel call runs the balanced plan: tiles_per_split (int32 [1]) is given exactly
  when config.split_plan is "balanced"."""
  balanced = config.split_plan == "balanced"
  if balanced != (tiles_per_split is not None):
    raise ValueError(f"tiles_per_split must be given exactly when config.split_plan is 'balanced'; got "
                     f"{config.split_plan=} and tiles_per_split={'None' if tiles_per_split is None else 'an array'}")
  if balanced and (tiles_per_split.shape != (1,) or tiles_per_split.dtype != jnp.int32):
    raise ValueError(f"tiles_per_split must be int32 [1], got {tiles_per_split.shape=} {tiles_per_split.dtype=}")
  return balanced


def check_sequence_order(sequence_order, config: DecodeConfig, *, batch: int) -> bool:
  """Whether programs take sequences in a given order: sequence_order (int32 [B], a permutation
  of the batch) is given exactly when config.sequence_order is not "given"."""
  ordered = config.sequence_order != "given"
  if ordered != (sequence_order is not None):
    raise ValueError(f"sequence_order must be given exactly when config.sequence_order is not 'given'; got "
                     f"{config.sequence_order=} and sequence_order={'None' if sequence_order is None else 'an array'}")
  if ordered and (sequence_order.shape != (batch,) or sequence_order.dtype != jnp.int32):
    raise ValueError(f"sequence_order must be int32 [B]=[{batch}], got {sequence_order.shape=} "
                     f"{sequence_order.dtype=}")
  return ordered


def longest_first(lengths):
  """int32 [B]: the batch's sequences by length, longest first (ties in batch order)."""
  return jnp.argsort(-lengths.astype(jnp.int32), stable=True).astype(jnp.int32)


def long_short(lengths):
  """int32 [B]: longest, shortest, second longest, second shortest, ... (`longest_first` order
  taken from both ends in turn)."""
  by_length = longest_first(lengths)
  n = by_length.shape[0]
  i = jnp.arange(n, dtype=jnp.int32)
  return by_length[jnp.where(i % 2 == 0, i // 2, n - 1 - i // 2)]


# DecodeConfig.sequence_order -> the permutation it takes; "given" (batch order) needs none.
ORDER_FUNCTIONS = {"longest_first": longest_first, "long_short": long_short}


def sequence_order(lengths, config: DecodeConfig):
  """The `sequence_order` argument of a kernel call: config.sequence_order's permutation of these
  lengths, or None for batch order."""
  permutation = ORDER_FUNCTIONS.get(config.sequence_order)
  return None if permutation is None else permutation(lengths)


def split_plan(lengths, *, problem, config: DecodeConfig, window: int | None, row_blocks: int,
               programs_per_sm: int = 1, num_sms: int | None = None):
  """The `tiles_per_split` argument of a kernel call: the balanced plan of these lengths (clamped
  into [0, capacity]), or None for the per-sequence plan."""
  if config.split_plan != "balanced":
    return None
  chunks = balanced_chunks(num_kv_heads=problem.num_kv_heads, row_blocks=row_blocks,
                           num_sms=num_sms or runtime.num_sms(), programs_per_sm=programs_per_sm)
  lengths = jnp.clip(lengths, 0, problem.capacity)   # the kernels clamp them too, each on its own
  return balanced_tiles_per_split(lengths, block_kv=config.block_kv, num_queries=problem.num_queries,
                                  num_splits=config.num_splits, window=window, chunks=chunks)


# ---------------------------------------------------------------- the stream-K plan

def stream_k_programs(*, num_kv_heads: int, row_blocks: int, num_sms: int, programs_per_sm: int) -> int:
  """Programs per (kv head, row block) under the stream-K plan: one wave of the GPU's program
  slots, so that every program starts at once and, streaming the same number of tiles, they all
  end together."""
  return max(1, (num_sms * programs_per_sm) // (num_kv_heads * row_blocks))


def choose_stream_k_programs(*, num_kv_heads: int, row_blocks: int, num_sms: int, programs_per_sm: int = 1,
                             **_) -> int:
  """`stream_k_programs` with `choose_num_splits`' signature (the batch and length do not matter)."""
  return stream_k_programs(num_kv_heads=num_kv_heads, row_blocks=row_blocks, num_sms=num_sms,
                           programs_per_sm=programs_per_sm)


@dataclasses.dataclass(frozen=True)
class StreamKLayout:
  """One call's stream-K plan over the batch's visible tiles, laid end to end in batch order
  (sequence b's tiles occupy [ends[b] - tiles[b], ends[b])); program w of a (kv head, row block)
  streams [w * chunk, (w + 1) * chunk) of them, crossing sequence boundaries. Vectors are [B'],
  B' >= B (padding sequences have no tiles); every field is a traced int32 value, so the same
  code plans in the kernel and in tests."""
  first: object    # [B'] first visible tile of each sequence
  tiles: object    # [B'] visible tiles of each sequence
  ends: object     # [B'] inclusive running sum of tiles
  chunk: object    # scalar: tiles per program (>= 1)
  total: object    # scalar: the batch's visible tiles

  @classmethod
  def of(cls, lengths, *, block_kv: int, num_queries: int, window: int | None, num_programs: int):
    """The plan of lengths [B'] (already clamped into [0, capacity]) for num_programs programs."""
    first, end = visible_tiles(lengths, block_kv=block_kv, num_queries=num_queries, window=window)
    tiles = jnp.maximum(end - first, 0).astype(jnp.int32)
    total = jnp.sum(tiles)
    first = jnp.broadcast_to(first, tiles.shape).astype(jnp.int32)   # 0 (an int) without a window
    return cls(first=first, tiles=tiles, ends=jnp.cumsum(tiles).astype(jnp.int32),
               chunk=jnp.maximum(cdiv(total, num_programs), 1), total=total)

  def program_range(self, w):
    """Program w's tiles [lo, hi) in the batch's tile order."""
    lo = jnp.minimum(w * self.chunk, self.total)
    return lo, jnp.minimum(lo + self.chunk, self.total)

  def locate(self, g):
    """(b, start) of batch tile g < total: the sequence that holds it and the position of that
    sequence's first tile in the batch's tile order. Two reductions over [B'] and no pick, so
    that the stream-K kernel's tile loop finds each tile's sequence from the tile alone."""
    before = self.ends <= g   # sequences wholly before g (empty ones too)
    return jnp.sum(before.astype(jnp.int32)), jnp.sum(jnp.where(before, self.tiles, 0))

  def pieces(self, b):
    """(the first program holding sequence b's tiles, how many programs do, whether the first
    program's piece starts mid-chunk). A sequence without tiles has 0 pieces."""
    seq_end = pick(self.ends, b)
    return self.pieces_of_span(seq_end - pick(self.tiles, b), seq_end)

  def pieces_of_span(self, seq_start, seq_end):
    """`pieces` of the sequence whose tiles are [seq_start, seq_end) in the batch's tile order."""
    first_program = seq_start // self.chunk
    last_program = (seq_end - 1) // self.chunk
    count = jnp.where(seq_end > seq_start, last_program - first_program + 1, 0)
    return first_program, count, seq_start != first_program * self.chunk

  @staticmethod
  def piece_slot(starts_mid_chunk, is_first_piece):
    """Where a piece's partial goes among its program's two slots: 0 for a piece that starts at
    its program's chunk start (a program's first segment), 1 for one that starts inside it (its
    last segment, continued by the next program). Only the first piece of a sequence can start
    inside a chunk, so a program never needs a third slot."""
    return jnp.where(is_first_piece & starts_mid_chunk, 1, 0)


def pick(vector, index):
  """vector[index] for a traced index, as a masked sum (a Pallas Triton kernel cannot index a
  value it holds in registers)."""
  hit = jnp.arange(vector.shape[0], dtype=jnp.int32) == index
  return jnp.sum(jnp.where(hit, vector, jnp.zeros_like(vector)))


# ---------------------------------------------------------------- rows and merging

def pack_queries(q4, num_kv_heads: int):
  """[B, S, Hq, D] -> [B, Hkv, S * G, D]."""
  b, s, hq, d = q4.shape
  g = hq // num_kv_heads
  return q4.reshape(b, s, num_kv_heads, g, d).transpose(0, 2, 1, 3, 4).reshape(b, num_kv_heads, s * g, d)


def unpack_rows(x, num_queries: int):
  """[B, Hkv, S * G, ...] -> [B, S, Hq, ...], the inverse of pack_queries."""
  b, hkv, r = x.shape[:3]
  g = r // num_queries
  rest = x.shape[3:]
  x = x.reshape(b, hkv, num_queries, g, *rest)
  x = jnp.moveaxis(x, 2, 1)  # [B, S, Hkv, G, ...]
  return x.reshape(b, num_queries, hkv * g, *rest)


def merge_splits(out, lse, sinks=None):
  """Merges split-K partials.

  Args:
    out: [B, Hkv, splits, R, Dv], each split's softmax-normalised output (0 with one split where
      it saw no key; with several, any values there: ignored, the MLA kernel leaves them
      unwritten): float32, or 16-bit (summed in float32).
    lse: [B, Hkv, splits, R] float32, each split's log-sum-exp (-inf where empty).
    sinks: optional [Hkv, R] float32 sink logit of each packed row; joins the denominator only.
  Returns:
    (out [B, Hkv, R, Dv] float32, lse [B, Hkv, R] float32 over the real keys, -inf where none).
  """
  if out.shape[2] == 1 and sinks is None:  # one split is already the answer: skip the merge
    return out[:, :, 0], lse[:, :, 0]
  out = out.astype(jnp.float32)
  total = jnp.max(lse, axis=2)  # [B, Hkv, R]
  shift = jnp.where(jnp.isfinite(total), total, 0.0)
  weights = jnp.exp(lse - shift[:, :, None])  # empty splits weigh 0
  norm = jnp.sum(weights, axis=2)
  has_keys = norm > 0
  lse_total = jnp.where(has_keys, jnp.log(jnp.where(has_keys, norm, 1.0)) + shift, -jnp.inf)
  denom = norm
  if sinks is not None:
    denom = denom + jnp.exp(sinks[None].astype(jnp.float32) - shift)
  merged = jnp.einsum("bhsr,bhsrd->bhrd", weights, jnp.where((lse > -jnp.inf)[..., None], out, 0.0))
  merged = merged / jnp.where(has_keys, denom, 1.0)[..., None]
  return merged, lse_total


# ---------------------------------------------------------------- around a kernel

def scale_kind(scale, k_shape) -> str | None:
  """None (no scale), "head" (float32 [Hkv]) or "token" (float32 [*k_shape[:2], Hkv]: per token
  and kv head, with the cache's leading dims: [B, T, Hkv] contiguous, [P, page_size, Hkv] paged)."""
  if scale is None:
    return None
  hkv = k_shape[2]
  if tuple(scale.shape) == (hkv,):
    return "head"
  if tuple(scale.shape) == (*k_shape[:2], hkv):
    return "token"
  raise ValueError(f"a scale must be [Hkv]=({hkv},) or [{k_shape[0]}, {k_shape[1]}, {hkv}]; got {tuple(scale.shape)}")


def check_packed_args(q, k, v, lengths, block_tables, *, num_queries: int, k_scale=None, v_scale=None,
                      v_tokens_last: bool = False) -> None:
  """The layout every backend's `decode_partials` takes: q packed as [B, Hkv, R, D] in bf16 or
  fp16; k and v alike (v tokens last: k's dims 0, 2, 3, 1), in q's dtype or a one-byte dtype
  (QUANTIZED_DTYPES) with optional float32 scales (`scale_kind`); int32 lengths [B]; int32
  block_tables [B, max_pages] (paged only)."""
  if q.ndim != 4:
    raise ValueError(f"q must be packed rows [B, Hkv, R, D], got {q.shape=}")
  if k.ndim != 4 or v.shape != (validation.tokens_last_shape(k.shape) if v_tokens_last else k.shape):
    raise ValueError(f"k must be 4-d and v {'its dims 0, 2, 3, 1' if v_tokens_last else 'of its shape'}, "
                     f"got {k.shape=} {v.shape=}")
  B, Hkv, R, D = q.shape
  if k.shape[2:] != (Hkv, D):
    raise ValueError(f"k's heads and head_dim {k.shape[2:]=} must match q's {(Hkv, D)}")
  if jnp.dtype(q.dtype) not in KV_DTYPES:
    raise ValueError(f"q.dtype={jnp.dtype(q.dtype).name} must be bfloat16 or float16")
  if v.dtype != k.dtype or (k.dtype != q.dtype and jnp.dtype(k.dtype) not in QUANTIZED_DTYPES):
    raise ValueError(f"k and v must share q's dtype or a one-byte dtype "
                     f"({', '.join(d.name for d in QUANTIZED_DTYPES)}), got {q.dtype=} {k.dtype=} {v.dtype=}")
  for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
    if scale is not None:
      if scale.dtype != jnp.float32:
        raise ValueError(f"{name} must be float32, got {scale.dtype}")
      scale_kind(scale, k.shape)
  if num_queries < 1 or R % num_queries:
    raise ValueError(f"{num_queries=} must be >= 1 and divide the packed rows {R=}")
  if lengths.shape != (B,) or lengths.dtype != jnp.int32:
    raise ValueError(f"lengths must be int32 [{B}], got {lengths.shape=} {lengths.dtype=}")
  if block_tables is None:
    if k.shape[0] != B:
      raise ValueError(f"dense k must be [B={B}, T, Hkv, D], got {k.shape=}")
  elif block_tables.ndim != 2 or block_tables.shape[0] != B or block_tables.dtype != jnp.int32:
    raise ValueError(f"block_tables must be int32 [B={B}, max_pages], got {block_tables.shape=} "
                     f"{block_tables.dtype=}")


def compute_dtype(kv_dtype):
  """The dtype of the kernels' matmul operands: a 16-bit cache's own; float16 for a one-byte
  cache, which widens to it exactly after the load (int8 and both fp8 kinds are float16 values;
  float16 keeps 3 more mantissa bits of q and P than bfloat16)."""
  if jnp.dtype(kv_dtype) in KV_DTYPES:
    return jnp.dtype(kv_dtype)
  return jnp.dtype(jnp.float16)


def kernel_scale(scale, num_kv_heads: int):
  """A public k_scale / v_scale as the kernels take it: None, float32 [Hkv] (a number or a scalar
  broadcast to every head), or the per-token array in float32."""
  if scale is None:
    return None
  scale = jnp.asarray(scale, jnp.float32)
  return jnp.broadcast_to(scale, (num_kv_heads,)) if scale.ndim == 0 else scale


def packed_sinks(sinks, problem):
  """Per-head sink logits [Hq] as float32 [Hkv, R] per packed row (`pack_queries`)."""
  per_head = jnp.broadcast_to(sinks.astype(jnp.float32)[None, None, :, None],
                              (1, problem.num_queries, problem.num_heads, 1))
  return pack_queries(per_head, problem.num_kv_heads)[0, ..., 0]


def run(partials: Callable, q, k, lengths, block_tables, *, problem, sinks, return_lse: bool, k_scale=None,
        v_scale=None, merged: bool = False, merge: Callable | None = None):
  """Packs q into kernel rows, calls partials(rows, lengths, block_tables, k_scale, v_scale) ->
  (out, lse) per split ([B, Hkv, splits, >= R, D], [B, Hkv, splits, >= R]), merges the splits and
  unpacks the rows.

  The splits merge in XLA (`merge_splits`), or, given merge, in its launch:
  merge(out, lse, row_sinks, rows=R, out_dtype=q.dtype, return_lse=...) -> (out [B, Hkv, R, D]
  in q's dtype, lse or None), as `pallas_kv.kernels.triton.merge.merge_partials` does.

  merged=True: the kernel merges its splits itself (sinks included):
  partials(rows, lengths, block_tables, k_scale, v_scale, row_sinks) -> (out [B, Hkv, R, D],
  lse [B, Hkv, R] float32 or None when not return_lse), row_sinks `packed_sinks` or None.

  Lengths and page ids reach the kernel as int32, unclamped: every kernel clamps them itself
  (into [0, T] and [0, P)), which spares a launch before it; scales come as `kernel_scale` makes
  them.
  """
  q4, single = validation.query_as_rank4(q)
  rows = pack_queries(q4, problem.num_kv_heads).astype(compute_dtype(k.dtype))  # [B, Hkv, R = S*G, D]
  num_rows = rows.shape[2]
  lengths = lengths.astype(jnp.int32)
  if block_tables is not None:
    block_tables = block_tables.astype(jnp.int32)
  row_sinks = None if sinks is None else packed_sinks(sinks, problem)
  k_scale = kernel_scale(k_scale, problem.num_kv_heads)
  v_scale = kernel_scale(v_scale, problem.num_kv_heads)
  if merged:
    out, lse = partials(rows, lengths, block_tables, k_scale, v_scale, row_sinks)
  else:
    out, lse = partials(rows, lengths, block_tables, k_scale, v_scale)
    if merge is not None and out.shape[2] > 1:
      out, lse = merge(out, lse, row_sinks, rows=num_rows, out_dtype=q.dtype, return_lse=return_lse)
    else:
      out, lse = out[:, :, :, :num_rows], lse[:, :, :, :num_rows]  # drop rows a kernel padded
      out, lse = merge_splits(out, lse, row_sinks)
  out = unpack_rows(out, problem.num_queries)
  if not return_lse:
    return out[:, 0] if single else out
  lse = unpack_rows(lse, problem.num_queries)
  return (out[:, 0], lse[:, 0]) if single else (out, lse)
