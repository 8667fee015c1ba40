"""A GPT-2-style byte-level BPE tokenizer built from a GGUF file's metadata, and the chat template.

Encoding: control tokens (`<|im_start|>`, ...) are cut out of the text whole; the rest is split
into pieces by GPT-2's pattern
    's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+
(a small scanner over Unicode categories: the standard `re` module has no \\p{L}); each piece's
UTF-8 bytes are spelled in GPT-2's printable byte alphabet and merged pair by pair, lowest merge
rank first. This matches the tokenizer transformers builds from the same file (its GGUF loader
gives SmolLM2's "smollm" pre-tokenizer that same pattern).
"""

from __future__ import annotations

import functools
import re
import unicodedata

from examples.smollm2.gguf_loader import TokenizerData

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types that are matched whole in the text
CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d")


@functools.cache
def byte_alphabet() -> dict[int, str]:
  """GPT-2's map from each byte to a printable character (printable Latin-1 bytes map to themselves)."""
  kept = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
  chars, extra = {}, 0
  for b in range(256):
    if b in kept:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return chars


def _is_space(c: str) -> bool:
  return c.isspace() and not "\x1c" <= c <= "\x1f"  # Unicode White_Space (isspace adds \x1c-\x1f)


def _is_letter(c: str) -> bool:
  return unicodedata.category(c)[0] == "L"


def _is_number(c: str) -> bool:
  return unicodedata.category(c)[0] == "N"


def _is_other(c: str) -> bool:
  return not (_is_space(c) or _is_letter(c) or _is_number(c))


def _run(text: str, start: int, accept) -> int:
  end = start
  while end < len(text) and accept(text[end]):
    end += 1
  return end


def split_pieces(text: str) -> list[str]:
  """GPT-2's pre-tokenization of text (without control tokens) into pieces."""
  pieces, i, n = [], 0, len(text)
  while i < n:
    end = None
    for c in CONTRACTIONS:
      if text.startswith(c, i):
        end = i + len(c)
        break
    if end is None:
      j = i + (text[i] == " ")
      for accept in (_is_letter, _is_number, _is_other):  # ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`
        if j < n and accept(text[j]):
          end = _run(text, j, accept)
          break
    if end is None:  # a run of whitespace: `\s+(?!\S)` leaves its last one to the next piece
      run_end = _run(text, i, _is_space)
      end = run_end - 1 if run_end < n and run_end - i > 1 else run_end
    pieces.append(text[i:end])
    i = end
  return pieces


class Tokenizer:
  """Byte-level BPE: `encode(text) -> ids`, `decode(ids) -> text`."""

  def __init__(self, data: TokenizerData):
    if data.model != "gpt2":
      raise NotImplementedError(f"tokenizer model {data.model!r} is not supported; this reads byte-level BPE (gpt2)")
    self.tokens = data.tokens
    self.vocab = {token: i for i, token in enumerate(data.tokens)}
    self.ranks = {tuple(merge.split(" ", 1)): rank for rank, merge in enumerate(data.merges)}
    self.special_ids = {i for i, t in enumerate(data.token_types) if t in (CONTROL, USER_DEFINED)}
    specials = sorted((data.tokens[i] for i in self.special_ids), key=len, reverse=True)
    self._special_pattern = re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None
    self.bos_token_id, self.eos_token_id = data.bos_token_id, data.eos_token_id
    self.chat_template = data.chat_template
    self._to_byte = {c: b for b, c in byte_alphabet().items()}
    self._bpe = functools.lru_cache(maxsize=1 << 16)(self._merge)

  @property
  def vocab_size(self) -> int:
    return len(self.tokens)

  def _merge(self, word: str) -> tuple[str, ...]:
    """The BPE symbols of one piece spelled in the byte alphabet."""
    symbols = list(word)
    while len(symbols) > 1:
      ranked = [(self.ranks.get(pair, None), k) for k, pair in enumerate(zip(symbols, symbols[1:]))]
      ranked = [(r, k) for r, k in ranked if r is not None]
      if not ranked:
        break
      best = min(ranked)[0]
      merged, k = [], 0
      while k < len(symbols):  # merge every occurrence of the best pair, left to right
        if k + 1 < len(symbols) and self.ranks.get((symbols[k], symbols[k + 1])) == best:
          merged.append(symbols[k] + symbols[k + 1])
          k += 2
        else:
          merged.append(symbols[k])
          k += 1
      symbols = merged
    return tuple(symbols)

  def _encode_ordinary(self, text: str) -> list[int]:
    alphabet = byte_alphabet()
    ids = []
    for piece in split_pieces(text):
      for symbol in self._bpe("".join(alphabet[b] for b in piece.encode("utf-8"))):
        if symbol not in self.vocab:
          raise ValueError(f"BPE symbol {symbol!r} is not in the vocabulary")
        ids.append(self.vocab[symbol])
    return ids

  def encode(self, text: str) -> list[int]:
    """Token ids of text; control tokens written in the text become their ids (no BOS is added)."""
    if self._special_pattern is None:
      return self._encode_ordinary(text)
    ids = []
    for k, part in enumerate(self._special_pattern.split(text)):
      if k % 2:
        ids.append(self.vocab[part])
      elif part:
        ids.extend(self._encode_ordinary(part))
    return ids

  def decode(self, ids, skip_special: bool = False) -> str:
    """Text of token ids (invalid UTF-8, e.g. half a character, becomes U+FFFD)."""
    out = bytearray()
    for i in ids:
      i = int(i)
      if skip_special and i in self.special_ids:
        continue
      token = self.tokens[i]
      if i in self.special_ids:
        out += token.encode("utf-8")
      else:
        out += bytes(self._to_byte[c] for c in token)
    return out.decode("utf-8", errors="replace")

  def chat_prompt(self, user_message: str, system: str | None = None) -> str:
    """The prompt text of a one-turn chat, ending where the assistant's reply begins.

    Implements the file's ChatML template: a system turn (the template's default system message
    unless `system` is given), the user turn, then `<|im_start|>assistant\\n`.
    """
    template = self.chat_template or ""
    if "<|im_start|>" not in template:
      raise NotImplementedError("only ChatML chat templates (<|im_start|>role ... <|im_end|>) are supported")
    if system is None:
      found = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", template, re.S)
      system = found.group(1) if found else None
    turns = [("system", system)] if system is not None else []
    turns.append(("user", user_message))
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns) + "<|im_start|>assistant\n"
