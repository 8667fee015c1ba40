"""The shape of the house: imports point down, library code never imports the test oracle, no
module reaches into another's private names, and no file grows past its limit."""

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = REPO / "pallas_kv"
BENCHMARKS = REPO / "benchmarks"

# Layers of the library, lowest first: a module may import only from lower layers (its own layer
# never: no module of a layer needs another of the same layer).
LAYERS = [
    {"validation", "config", "runtime"},
    # the online softmax's math imports nothing of the package: the kernels and shared_prefix's merge use it
    {"tuned", "cache", "online_softmax"},
    # the Mosaic GPU kernels' named regions and their on-device trace (a diagnostic, importing nothing here)
    {"xla", "batching", "varlen", "shared_prefix", "kernels.plan", "kernels.frame", "kernels.mosaic_gpu.trace"},
    # the Mosaic GPU GQA kernel's work items (which tiles each program streams, the stream-K walk's segments)
    {"kernels.mosaic_gpu.pipeline", "kernels.mosaic_gpu.work", "kernels.triton.stream_k_plan"},
    # the KV tiles and the per-token scales' copies, shaped by the ring's TMA alignment
    {"kernels.mosaic_gpu.tiling"},
    {"kernels.mosaic_gpu.config", "kernels.triton.config"},
    # sizes the MLA kernel from the backend config's SMEM capacity; the Triton kernel body's pieces
    {"kernels.mosaic_gpu.mla_config", "kernels.triton.tiles"},
    # the MLA kernel's output stores (its SMEM staging's rows) and per-tile pieces; the Triton
    # kernel's merged outputs
    {"kernels.mosaic_gpu.mla_output", "kernels.mosaic_gpu.mla_tiles", "kernels.triton.outputs"},
    # the Triton stream-K kernel body, which the decode kernel dispatches to; the GQA kernel's fp8-operand
    # consumer (Q's terms split as MLA's are)
    {"kernels.triton.stream_k", "kernels.mosaic_gpu.fp8_operands"},
    # the GQA kernel's one-byte tile feeds (widening into a consumer's tile or the converter's ring)
    {"kernels.mosaic_gpu.tile_feeds"},
    # the GQA kernel's 16-bit consumer with the queries as wgmma N (V's slots through the tile feeds)
    {"kernels.mosaic_gpu.queries_as_n"},
    {"kernels.mosaic_gpu.decode", "kernels.mosaic_gpu.mla", "kernels.triton.decode"},
    # the merge launches: the Triton one takes the Triton decode module's compiler params; Mosaic GPU's (where
    # Pallas Triton is gone) the online softmax's row helpers
    {"kernels.triton.merge", "kernels.mosaic_gpu.merge"},
    {"kernels.mosaic_gpu.backend", "kernels.triton.backend"},
    {"api"},
    {"experimental.mla_schedules"},   # the MLA kernel's experimental consumers, which the variant config names
    {"module", "sharding", "reference", "experimental", "experimental.mosaic_merge"},
    {""},   # __init__: re-exports only
]
MAX_LIBRARY_LINES = 800
MAX_BENCHMARK_LINES = 500


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(LIBRARY).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def _layer(name: str) -> int:
  for rank, layer in enumerate(LAYERS):
    if name in layer:
      return rank
  raise AssertionError(f"pallas_kv.{name} is in no layer of tests/test_layout.py: place it")


def _imports(path: pathlib.Path):
  """(module imported, names taken from it) of every import in the file, function-local ones too."""
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield alias.name, []
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      yield node.module, [alias.name for alias in node.names]


def _library_modules():
  return sorted(p for p in LIBRARY.rglob("*.py") if "kernels" not in p.parts or p.name != "__init__.py")


def _is_module(name: str) -> bool:
  path = LIBRARY / name.replace(".", "/")
  return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _pallas_kv_targets(module: str, names):
  """The pallas_kv modules an import statement reaches: `from pallas_kv.a import b` reaches a.b
  when that is a module, else a."""
  if module != "pallas_kv" and not module.startswith("pallas_kv."):
    return []
  base = module[len("pallas_kv."):] if module != "pallas_kv" else ""
  if not names:
    return [base]
  targets = []
  for name in names:
    full = f"{base}.{name}" if base else name
    targets.append(full if _is_module(full) else base)
  return targets


@pytest.mark.parametrize("path", _library_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_library_imports_point_down(path):
  importer = _module_name(path)
  for module, names in _imports(path):
    for target in _pallas_kv_targets(module, names):
      if importer == "":   # __init__ re-exports the public names of every layer
        continue
      target_module = target
      assert target_module != "reference", f"{path.name} imports the test oracle pallas_kv.reference"
      assert _layer(target_module) < _layer(importer), (
          f"pallas_kv.{importer} imports pallas_kv.{target_module}, which is not below it")


def _python_files():
  files = list(LIBRARY.rglob("*.py")) + list(BENCHMARKS.glob("*.py")) + list((REPO / "examples").glob("*.py"))
  return sorted(files)


@pytest.mark.parametrize("path", _python_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_private_names_of_other_modules(path):
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("pallas_kv", "benchmarks"):
      private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
      assert not private, f"{path.name} imports private names {private} from {node.module}"
    if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
      base = node.value
      # module._name, where module is a pallas_kv or benchmarks module bound by an import
      if isinstance(base, ast.Name) and base.id in _imported_project_modules(tree):
        raise AssertionError(f"{path.name}:{node.lineno} reaches into {base.id}.{node.attr}")


def _imported_project_modules(tree) -> set[str]:
  bound = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("pallas_kv", "benchmarks"):
      bound.update(a.asname or a.name for a in node.names)
    elif isinstance(node, ast.Import):
      bound.update(a.asname or a.name.split(".")[0] for a in node.names
                   if a.name.split(".")[0] in ("pallas_kv", "benchmarks"))
  return bound


@pytest.mark.parametrize("path", _python_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_file_sizes(path):
  limit = MAX_BENCHMARK_LINES if BENCHMARKS in path.parents else MAX_LIBRARY_LINES
  lines = len(path.read_text().splitlines())
  assert lines <= limit, f"{path.relative_to(REPO)} has {lines} lines, over {limit}: split it"


def test_benchmarks_import_no_fallbacks():
  for path in BENCHMARKS.glob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Try):
        caught = [h.type for h in node.handlers if h.type is not None]
        names = {getattr(t, "id", None) for t in caught}
        body_imports = [n for n in node.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert not (body_imports and "ImportError" in names and all(
            isinstance(n, (ast.Import, ast.ImportFrom)) and (getattr(n, "module", "") or "").startswith(
                ("benchmarks",)) or any(a.name.startswith("benchmarks") for a in getattr(n, "names", []))
            for n in body_imports)), f"{path.name}:{node.lineno}: import fallback; run as python -m benchmarks.X"
