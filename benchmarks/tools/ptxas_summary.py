r"""Registers and spills of the Mosaic GPU kernels, from ptxas's own report: one line per kernel.

  python3 -m benchmarks.tools.ptxas_summary --compile=kernel,kernel_alt --dump_dir=/tmp/d --keep_ptx=ptx/
  python3 -m benchmarks.tools.ptxas_summary /tmp/d                 # a folder of *.ptxas files dumped earlier
  python3 -m benchmarks.tools.ptxas_summary --ptx=ptx/KERNEL.ptx.gz [--consumer_registers=240 --producer_registers=24]

`--compile` (GPU only: ptxas runs when Mosaic GPU compiles for the device) compiles each named
`benchmarks.mla` impl once on one row (`--row`), with Mosaic GPU told to keep ptxas's output and
the PTX (MOSAIC_GPU_DUMP_PTXAS, MOSAIC_GPU_DUMP_PTX, MOSAIC_GPU_DUMP_TO), then prints the summary;
nothing runs. `--keep_ptx` copies one gzipped PTX per kernel out of the dump.

`--ptx` needs no GPU, only the CUDA toolkit's ptxas and nvdisasm on the PATH: it compiles a kept
PTX for sm_90a, optionally with other `setmaxnreg` counts for the warpgroups that raise (consumers)
or lower (producer) theirs, and prints the summary and the spill instructions (STL / LDL) in the
code after each `setmaxnreg`: what another MLA register split (`mla_config.RegisterSplit`) would
do to the spills, before any GPU time.

Per kernel (a kernel compiled several times is listed once): registers ptxas allocated at launch
(with setmaxnreg the consumers run with more: `mla_config.RegisterSplit`), the
stack frame, spill stores and loads in bytes, how many `warpgroup.arrive` ptxas injected before a
wgmma that reads registers (info C7519), and ptxas's warnings other than spills, e.g. wgmma
serialized: a spill inside the consumers' loop, or a serialized wgmma, costs more than any
schedule gains.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence

from absl import app
from absl import flags

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_USED = re.compile(r"Used (\d+) registers")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_INJECTED = re.compile(r"\(C7519\) warpgroup\.arrive is injected")
_WARNING = re.compile(r"ptxas warning\s*:\s*(.*)")
_SPILL_WARNING = "Registers are spilled"


@dataclasses.dataclass(frozen=True)
class KernelReport:
  """What ptxas said about one kernel."""
  name: str
  registers: int
  stack_bytes: int
  spill_store_bytes: int
  spill_load_bytes: int
  injected_arrives: int
  warnings: tuple[str, ...]

  @property
  def spills(self) -> bool:
    return self.spill_store_bytes > 0 or self.spill_load_bytes > 0


def parse(text: str) -> list[KernelReport]:
  """The kernels of one ptxas report (`ptxas -v` output), in order. Warnings and infos name their
  kernel anywhere in the text; the stack frame and register lines follow its entry line."""
  lines = text.splitlines()
  entries = [(i, m.group(1)) for i, line in enumerate(lines) if (m := _ENTRY.search(line))]
  reports = []
  for k, (start, name) in enumerate(entries):
    block = lines[start:entries[k + 1][0] if k + 1 < len(entries) else len(lines)]
    frame = next((m for line in block if (m := _FRAME.search(line))), None)
    used = next((m for line in block if (m := _USED.search(line))), None)
    about = [line for line in lines if f"'{name}'" in line]
    reports.append(KernelReport(
        name=name, registers=int(used.group(1)) if used else 0,
        stack_bytes=int(frame.group(1)) if frame else 0,
        spill_store_bytes=int(frame.group(2)) if frame else 0,
        spill_load_bytes=int(frame.group(3)) if frame else 0,
        injected_arrives=sum(1 for line in about if _INJECTED.search(line)),
        warnings=tuple(w.group(1).strip() for line in about
                       if (w := _WARNING.search(line)) and _SPILL_WARNING not in line)))
  return reports


def read_folder(folder: str) -> list[KernelReport]:
  """Every kernel of the *.ptxas files in folder, once each (the first report of a name)."""
  seen: dict[str, KernelReport] = {}
  for path in sorted(glob.glob(os.path.join(folder, "*.ptxas"))):
    with open(path) as f:
      for report in parse(f.read()):
        seen.setdefault(report.name, report)
  return list(seen.values())


def format_table(reports: Sequence[KernelReport]) -> str:
  width = max([len("kernel"), *(len(r.name) for r in reports)])
  header = (f"{'kernel':<{width}} {'regs':>5} {'stack B':>8} {'spill st B':>10} {'spill ld B':>10} "
            f"{'inj. arrive':>11}  warnings")
  lines = [header, "-" * len(header)]
  for r in reports:
    lines.append(f"{r.name:<{width}} {r.registers:>5} {r.stack_bytes:>8} {r.spill_store_bytes:>10} "
                 f"{r.spill_load_bytes:>10} {r.injected_arrives:>11}  {'; '.join(r.warnings)}")
  return "\n".join(lines)


_PTX_ENTRY = re.compile(r"\.visible \.entry (\w+)\(")
_SETMAXNREG = re.compile(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32 (\d+);")


def keep_ptx(dump_dir: str, keep_dir: str) -> list[str]:
  """Copies the first PTX of each kernel in dump_dir to keep_dir as KERNEL.ptx.gz; returns the names."""
  os.makedirs(keep_dir, exist_ok=True)
  kept = []
  for path in sorted(glob.glob(os.path.join(dump_dir, "*.ptx"))):
    with open(path, "rb") as f:
      text = f.read()
    entry = _PTX_ENTRY.search(text.decode(errors="replace"))
    if entry and entry.group(1) not in kept:
      kept.append(entry.group(1))
      with gzip.open(os.path.join(keep_dir, f"{entry.group(1)}.ptx.gz"), "wb") as out:
        out.write(text)
  return kept


def with_registers(ptx: str, *, consumer: int | None, producer: int | None) -> str:
  """ptx with its setmaxnreg counts replaced: inc (the consumers) by consumer, dec (the producer)
  by producer, where given."""
  def replace(m):
    count = {"inc": consumer, "dec": producer}[m.group(1)]
    return m.group(0) if count is None else f"setmaxnreg.{m.group(1)}.sync.aligned.u32 {count};"
  return _SETMAXNREG.sub(replace, ptx)


def spills_by_role(sass: str) -> dict[str, int]:
  """Spill instructions (STL / LDL) in SASS, by the register role in force where they sit: before
  any setmaxnreg ("launch"), after a decrease ("producer"), after an increase ("consumer")."""
  counts, role = {}, "launch"
  for line in sass.splitlines():
    if "USETMAXREG.DEALLOC" in line:
      role = "producer"
    elif "USETMAXREG" in line and "ALLOC" in line:
      role = "consumer"
    elif re.search(r"\b(STL|LDL)(\.|\s)", line):
      counts[role] = counts.get(role, 0) + 1
  return counts


def compile_ptx_locally(ptx_path: str, *, consumer: int | None, producer: int | None) -> tuple[str, str]:
  """(ptxas -v report, SASS) of a PTX file (.ptx or .ptx.gz) compiled here for sm_90a."""
  for tool in ("ptxas", "nvdisasm"):
    if shutil.which(tool) is None:
      raise app.UsageError(f"--ptx needs the CUDA toolkit's {tool} on the PATH")
  opener = gzip.open if ptx_path.endswith(".gz") else open
  with opener(ptx_path, "rt") as f:
    ptx = with_registers(f.read(), consumer=consumer, producer=producer)
  with tempfile.TemporaryDirectory() as tmp:
    src, cubin = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
    with open(src, "w") as f:
      f.write(ptx)
    report = subprocess.run(["ptxas", "-arch=sm_90a", "-v", "-O3", src, "-o", cubin], check=True,
                            capture_output=True, text=True)
    sass = subprocess.run(["nvdisasm", "-c", cubin], check=True, capture_output=True, text=True).stdout
  return report.stdout + report.stderr, sass


def compile_impls(impls: Sequence[str], row_name: str, dump_dir: str) -> None:
  """Compiles each benchmarks.mla impl once on a row, with ptxas's output and the PTX in dump_dir."""
  os.makedirs(dump_dir, exist_ok=True)
  os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"   # read when Mosaic GPU compiles, not at import
  os.environ["MOSAIC_GPU_DUMP_PTX"] = "1"
  os.environ["MOSAIC_GPU_DUMP_TO"] = dump_dir
  import jax   # pylint: disable=g-import-not-at-top
  from benchmarks import cases, mla   # pylint: disable=g-import-not-at-top
  if cases.default_is_cpu():
    raise app.UsageError("--compile needs a GPU: ptxas runs when Mosaic GPU compiles for the device")
  row = mla.ALL_ROWS[row_name]
  case = row.case()
  lengths = cases.make_lengths(case, jax.random.key(0))
  args = cases.make_input_sets(case, jax.random.key(1), lengths, 1)[0]
  for impl in impls:
    mla.build_fn(impl, row).lower(*args).compile()
    print(f"compiled {impl}", flush=True)


def main(argv: Sequence[str]) -> None:
  fv = flags.FLAGS
  if fv.ptx:
    report, sass = compile_ptx_locally(fv.ptx, consumer=fv.consumer_registers, producer=fv.producer_registers)
    print(format_table(parse(report)))
    print("spill instructions by role:", spills_by_role(sass))
    return
  folders = argv[1:]
  if fv.compile:
    compile_impls(fv.compile, fv.row, fv.dump_dir)
    folders = [fv.dump_dir]
    if fv.keep_ptx:
      print(f"kept the PTX of {len(keep_ptx(fv.dump_dir, fv.keep_ptx))} kernels in {fv.keep_ptx}")
  if not folders:
    raise app.UsageError("give a folder of *.ptxas files, --compile=IMPLS or --ptx=FILE")
  reports = [r for folder in folders for r in read_folder(folder)]
  if not reports:
    raise app.UsageError(f"no ptxas reports in {folders}")
  print(format_table(reports))


if __name__ == "__main__":
  flags.DEFINE_list("compile", None, "benchmarks.mla impls to compile (GPU only), e.g. kernel,kernel_alt.")
  flags.DEFINE_string("row", "h128_b64_t4096", "The benchmarks.mla row to compile them on.")
  flags.DEFINE_string("dump_dir", "ptxas_dump", "Where Mosaic GPU writes ptxas's output with --compile.")
  flags.DEFINE_string("keep_ptx", None, "With --compile: copy one gzipped PTX per kernel here.")
  flags.DEFINE_string("ptx", None, "A kept PTX (.ptx or .ptx.gz) to compile here with ptxas and nvdisasm.")
  flags.DEFINE_integer("consumer_registers", None, "With --ptx: the consumers' setmaxnreg count instead.")
  flags.DEFINE_integer("producer_registers", None, "With --ptx: the producer's setmaxnreg count instead.")
  app.run(main)
