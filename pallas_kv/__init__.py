"""pallas_kv: Pallas GPU kernels for the decode step of LLM attention."""

from pallas_kv.api import decode_attention as decode_attention
from pallas_kv.api import last_impl as last_impl
from pallas_kv.api import mla_decode_attention as mla_decode_attention
from pallas_kv.api import paged_decode_attention as paged_decode_attention
from pallas_kv.api import plan_splits as plan_splits
from pallas_kv.cache import KVCache as KVCache
from pallas_kv.config import MosaicGPUConfig as MosaicGPUConfig
from pallas_kv.config import MosaicMLAConfig as MosaicMLAConfig
from pallas_kv.config import TritonConfig as TritonConfig
from pallas_kv.kernels.plan import SplitPlan as SplitPlan
from pallas_kv.module import DecodeAttention as DecodeAttention
from pallas_kv.module import MLAConfig as MLAConfig
from pallas_kv.cache import PagedKVCache as PagedKVCache
from pallas_kv.cache import PagedLatentCache as PagedLatentCache
from pallas_kv.cache import PagePool as PagePool
from pallas_kv.cache import UNALLOCATED as UNALLOCATED
from pallas_kv.cache import drop_pages as drop_pages
from pallas_kv.cache import empty_block_tables as empty_block_tables
from pallas_kv.cache import fork_sequences as fork_sequences
from pallas_kv.cache import release_sequences as release_sequences
from pallas_kv.cache import reserve_pages as reserve_pages
from pallas_kv.cache import retain_pages as retain_pages
from pallas_kv.reference import decode_attention_reference as decode_attention_reference
from pallas_kv.reference import mla_decode_attention_reference as mla_decode_attention_reference
from pallas_kv.reference import paged_decode_attention_reference as paged_decode_attention_reference
from pallas_kv.runtime import checked as checked
from pallas_kv.shared_prefix import SharedPrefix as SharedPrefix
from pallas_kv.runtime import interpret as interpret

__version__ = "0.1.0"
