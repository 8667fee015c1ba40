"""Reads a Llama-architecture GGUF file: its config, its weights (dequantized, in bfloat16) and the
tokenizer fields of its metadata.

GGUF stores each weight as ggml writes it: a matrix of `out` rows of `in` values (numpy shape
[out, in], the layout of a torch Linear weight), quantized in blocks (Q4_1, Q8_0, ...) that
`gguf.quants.dequantize` turns back into float32. llama.cpp's converter permutes the rows of the
Q and K projections (per head, from the rotate-half order of Hugging Face's RoPE to interleaved
pairs); this loader undoes that exactly as transformers' GGUF loader does, so the weights and the
rotate-half RoPE of `pallas_kv.DecodeAttention` match the Hugging Face model.
"""

from __future__ import annotations

import dataclasses
import os

import ml_dtypes
import numpy as np

SUPPORTED_ARCHITECTURES = ("llama",)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """The dimensions of a Llama decoder (hashable: a static argument of jitted functions)."""
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-5
  max_position_embeddings: int = 2048
  tie_word_embeddings: bool = True
  bos_token_id: int | None = None
  eos_token_id: int | None = None

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")


@dataclasses.dataclass(frozen=True)
class TokenizerData:
  """The tokenizer fields of a GGUF file's metadata."""
  model: str  # "gpt2": byte-level BPE
  tokens: tuple[str, ...]
  token_types: tuple[int, ...]  # 1 normal, 3 control, 4 user-defined (llama.cpp's numbering)
  merges: tuple[str, ...]
  bos_token_id: int | None
  eos_token_id: int | None
  chat_template: str | None


def _fields(reader) -> dict:
  """The metadata as plain Python values (strings, numbers, lists)."""
  return {name: field.contents() for name, field in reader.fields.items()}


def _require(meta: dict, key: str, path):
  if key not in meta:
    raise ValueError(f"{os.fspath(path)}: metadata has no {key!r}")
  return meta[key]


def read_config(meta: dict, path="GGUF file") -> LlamaConfig:
  """A LlamaConfig from GGUF metadata; ValueError for an architecture other than llama."""
  arch = meta.get("general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"{os.fspath(path)}: architecture {arch!r} is not supported; "
                     f"this loader reads {', '.join(SUPPORTED_ARCHITECTURES)}")
  get = lambda key: _require(meta, f"{arch}.{key}", path)
  hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
  kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
  head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
  rope_dims = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
  if rope_dims != head_dim:
    raise NotImplementedError(f"{os.fspath(path)}: RoPE over {rope_dims} of {head_dim} dims is not supported")
  if f"{arch}.rope.scaling.type" in meta and meta[f"{arch}.rope.scaling.type"] not in ("none", ""):
    raise NotImplementedError(f"{os.fspath(path)}: RoPE scaling {meta[f'{arch}.rope.scaling.type']!r} "
                              "is not supported")
  tokens = meta.get("tokenizer.ggml.tokens")
  vocab = int(meta.get(f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
  return LlamaConfig(
      vocab_size=vocab, hidden_size=hidden, intermediate_size=int(get("feed_forward_length")),
      num_layers=int(get("block_count")), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
      rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
      rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
      max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
      bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"))


def read_tokenizer(meta: dict, path="GGUF file") -> TokenizerData:
  model = _require(meta, "tokenizer.ggml.model", path)
  tokens = _require(meta, "tokenizer.ggml.tokens", path)
  return TokenizerData(
      model=model, tokens=tuple(tokens), token_types=tuple(meta.get("tokenizer.ggml.token_type", [1] * len(tokens))),
      merges=tuple(meta.get("tokenizer.ggml.merges", ())), bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
      eos_token_id=meta.get("tokenizer.ggml.eos_token_id"), chat_template=meta.get("tokenizer.chat_template"))


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
  """Undoes llama.cpp's permutation of a Q or K weight [num_heads * head_dim, in]: within each
  head, rows (0, 1), (2, 3), ... (interleaved pairs) go back to rows (i, i + head_dim / 2)."""
  half = w.shape[0] // num_heads // 2
  return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Tensors:
  """The file's tensors by name, dequantized to float32 on request."""

  def __init__(self, reader, path):
    import gguf
    self._dequantize = gguf.quants.dequantize
    self._by_name = {t.name: t for t in reader.tensors}
    self._path = path

  def __contains__(self, name: str) -> bool:
    return name in self._by_name

  def __call__(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in self._by_name:
      raise ValueError(f"{os.fspath(self._path)}: tensor {name!r} is missing")
    t = self._by_name[name]
    w = np.asarray(self._dequantize(t.data, t.tensor_type), np.float32)
    if w.shape != shape:
      raise ValueError(f"{os.fspath(self._path)}: tensor {name!r} has shape {w.shape}; expected {shape}")
    return w


def load(path, dtype=ml_dtypes.bfloat16):
  """(LlamaConfig, params, TokenizerData) from a GGUF file; params hold `dtype` arrays (numpy).

  params: embed [V, H]; final_norm [H]; layers (stacked on a leading layer axis): attn_norm, mlp_norm
  [L, H], attn (DecodeAttention's wq [L, H, n, d], wk / wv [L, H, kv, d], wo [L, n, d, H]), w_gate,
  w_up [L, H, F], w_down [L, F, H]; lm_head [H, V] only when the file has an output matrix.
  """
  import gguf

  reader = gguf.GGUFReader(os.fspath(path))
  meta = _fields(reader)
  config = read_config(meta, path)
  tensors = _Tensors(reader, path)
  c, cast = config, lambda w: w.astype(dtype)
  h, n, kv, d, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size

  def layer(i: int) -> dict:
    get = lambda name, shape: tensors(f"blk.{i}.{name}.weight", shape)
    wq = unpermute_rows(get("attn_q", (n * d, h)), n)
    wk = unpermute_rows(get("attn_k", (kv * d, h)), kv)
    return dict(
        attn_norm=get("attn_norm", (h,)), mlp_norm=get("ffn_norm", (h,)),
        attn=dict(wq=wq.T.reshape(h, n, d), wk=wk.T.reshape(h, kv, d),
                  wv=get("attn_v", (kv * d, h)).T.reshape(h, kv, d), wo=get("attn_output", (h, n * d)).T.reshape(n, d, h)),
        w_gate=get("ffn_gate", (f, h)).T, w_up=get("ffn_up", (f, h)).T, w_down=get("ffn_down", (h, f)).T)

  layers = [layer(i) for i in range(c.num_layers)]
  stack = lambda *ws: cast(np.stack(ws))
  params = dict(embed=cast(tensors("token_embd.weight", (c.vocab_size, h))),
                final_norm=cast(tensors("output_norm.weight", (h,))),
                layers=_tree_map(stack, *layers))
  if "output.weight" in tensors:
    params["lm_head"] = cast(tensors("output.weight", (c.vocab_size, h)).T)
    config = dataclasses.replace(config, tie_word_embeddings=False)
  return config, params, read_tokenizer(meta, path)


def _tree_map(fn, *trees):
  if isinstance(trees[0], dict):
    return {k: _tree_map(fn, *(t[k] for t in trees)) for k in trees[0]}
  return fn(*trees)
