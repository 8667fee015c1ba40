"""Automatic prefix caching: full prompt pages kept past their requests and found again by their tokens.

A full page is keyed by the hash chain of its prompt up to its end: key(i) = hash((key(i - 1), the
page's token ids)). A token's keys and values depend only on the tokens up to it, so two prompts
whose chains agree up to page i have the same cache there, in every layer. An entry also keeps its
parent key and tokens, which a lookup compares: a hash collision is a miss, never a wrong page.

The cache holds one pool reference on each page it keys (`pallas_kv.retain_pages`), so a page
outlives the request that filled it; a request that reuses it takes one more (its block table's).
Entries are kept in least-recently-used order, a chain's deeper pages older than its shallower
ones, so eviction trims a chain from its tail. This is the host's bookkeeping only: the engine
takes and drops the references on the device.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import jax
import numpy as np

Link = tuple[int, int | None, tuple[int, ...]]  # (key, parent key, the page's token ids)


@dataclasses.dataclass
class Entry:
  """One cached page."""
  parent: int | None  # key of the prompt's previous page; None for its first
  tokens: tuple[int, ...]
  page: int | None = None  # pool page id; None until the prefill that fills it has been read
  owner: object | None = None  # the running request that reserved the page (its budget counts it)
  # Until then, where the page id will be: (that prefill's block-table row on the device, column).
  pending: tuple[jax.Array, int] | None = None


class PrefixCache:
  """Full prompt pages keyed by their hash chain, least recently used first."""

  def __init__(self, page_size: int):
    self.page_size = page_size
    self.entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()

  def __len__(self) -> int:
    return len(self.entries)

  def chain(self, prompt: Sequence[int]) -> list[Link]:
    """The links of the prompt's full pages, in order."""
    links, parent = [], None
    for start in range(0, len(prompt) - self.page_size + 1, self.page_size):
      tokens = tuple(int(t) for t in prompt[start:start + self.page_size])
      key = hash((parent, tokens))
      links.append((key, parent, tokens))
      parent = key
    return links

  def find(self, link: Link) -> Entry | None:
    """The entry of a link, if cached (with its parent and tokens, not just its hash)."""
    key, parent, tokens = link
    entry = self.entries.get(key)
    return entry if entry is not None and entry.parent == parent and entry.tokens == tokens else None

  def match(self, chain: list[Link], limit: int) -> list[int]:
    """Page ids of the longest run of cached pages at the chain's start, at most `limit`. A page whose
    prefill the host has not read yet is read now (a wait for that prefill alone): requests that
    arrive together then share a prompt that the first of them prefills."""
    pages = []
    for link in chain[:limit]:
      entry = self.find(link)
      if entry is None:
        break
      self.resolve([link[0]])
      pages.append(entry.page)
    return pages

  def add(self, link: Link, owner, row: jax.Array, column: int) -> None:
    """Keys the page that `owner`'s prefill put at `column` of its block-table row (read later)."""
    key, parent, tokens = link
    self.entries[key] = Entry(parent, tokens, owner=owner, pending=(row, column))

  def touch(self, chain: list[Link]) -> None:
    """Marks the chain's cached pages as just used, its first page the most recent."""
    for key, _, _ in reversed(chain):
      if key in self.entries:
        self.entries.move_to_end(key)

  def resolve(self, keys) -> None:
    """Reads the page ids of pending entries (waiting for their prefills)."""
    for key in keys:
      entry = self.entries.get(key)
      if entry is not None and entry.pending is not None:
        row, column = entry.pending
        entry.page, entry.pending = int(np.asarray(row)[column]), None

  def disown(self, owner) -> int:
    """The pages `owner` reserved become the cache's alone (it finished); returns how many."""
    owned = [entry for entry in self.entries.values() if entry.owner is owner]
    for entry in owned:
      entry.owner = None
    return len(owned)

  def evictable(self, ref_counts: np.ndarray, keep: set[int], limit: int) -> list[int]:
    """Keys of up to `limit` pages, least recently used first, that dropping frees: held by the
    cache alone (reference count 1), reserved by no running request and not in `keep`."""
    keys = []
    for key, entry in self.entries.items():
      if len(keys) == limit:
        break
      if entry.owner is None and entry.page is not None and entry.page not in keep and ref_counts[entry.page] == 1:
        keys.append(key)
    return keys

  def remove(self, keys) -> list[int]:
    """Forgets the entries; returns their page ids (the caller drops the cache's references)."""
    return [self.entries.pop(key).page for key in keys]

  def held_pages(self) -> list[int]:
    """The page id of every entry: each holds one reference (pending ones are read first)."""
    self.resolve(list(self.entries))
    return [entry.page for entry in self.entries.values()]
