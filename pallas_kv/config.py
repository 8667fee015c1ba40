"""Frozen, hashable descriptions of a call's options and of kernel configs."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
  """The static options of one call, after validation and defaults."""
  scale: float
  softcap: float | None = None
  window: int | None = None
  has_sinks: bool = False
  quantized: bool = False  # k_scale or v_scale given

  def __post_init__(self):
    if not self.scale > 0:
      raise ValueError(f"{self.scale=} must be positive")
    if self.softcap is not None and not self.softcap > 0:
      raise ValueError(f"{self.softcap=} must be positive or None")
    if self.window is not None and self.window < 1:
      raise ValueError(f"{self.window=} must be a positive int or None")
