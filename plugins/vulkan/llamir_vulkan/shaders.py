"""GLSL compute shaders, generated as variants of templates and compiled by glslc.

A template is `shaders/<name>.comp`; a variant is the template with `-D` defines (the element
types, the op, the workgroup size), as ggml-vulkan's vulkan-shaders-gen generates its shaders.
Every template includes `common.glsl` (the Tensor descriptor and indexing helpers) and may
include other `.glsl` files (the dequantizers). SPIR-V is cached on disk by a hash of the
sources, the defines and glslc's version, so a variant is compiled once per machine; the variants
a lowering (or a backend's precompile) needs are compiled side by side.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SHADER_DIR = Path(__file__).with_name("shaders")


class ShaderError(RuntimeError):
    """glslc is missing, or a shader variant does not compile (the message has glslc's output)."""


def find_glslc() -> str:
    """The glslc to compile with (LLAMIR_GLSLC, else the one on PATH); ShaderError if none."""
    path = os.environ.get("LLAMIR_GLSLC")
    if path:
        if not os.access(path, os.X_OK):
            raise ShaderError(f"LLAMIR_GLSLC={path} is not an executable glslc")
        return path
    path = shutil.which("glslc")
    if not path:
        raise ShaderError("glslc is not installed (apt-get install glslc, or set LLAMIR_GLSLC)")
    return path


@functools.cache
def glslc_version(glslc: str) -> str:
    out = subprocess.run([glslc, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.strip()


def cache_dir() -> Path:
    root = os.environ.get("LLAMIR_VULKAN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llamir", "vulkan")
    return Path(root)


def compile_workers() -> int:
    """glslc processes run side by side: LLAMIR_VULKAN_COMPILE_WORKERS, else one per CPU this
    process may use (at most 8: the optimizer takes up to ~1.5 GB on the largest variants)."""
    env = os.environ.get("LLAMIR_VULKAN_COMPILE_WORKERS")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ShaderError(f"LLAMIR_VULKAN_COMPILE_WORKERS={env} is not a positive integer")
        return int(env)
    return max(1, min(len(os.sched_getaffinity(0)), 8))


INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _sources(name: str) -> str:
    """A template's text with every file it includes (recursively), so a change to any of them
    changes the variant's hash, and a change elsewhere does not."""
    seen: list[str] = []

    def visit(file: str) -> None:
        if file in seen:
            return
        seen.append(file)
        path = SHADER_DIR / file
        if path.exists():
            for inc in INCLUDE.findall(path.read_text()):
                visit(inc)

    visit(f"{name}.comp")
    return "".join(f"// {f}\n{(SHADER_DIR / f).read_text() if (SHADER_DIR / f).exists() else ''}" for f in seen)


def variant_id(name: str, defines: dict[str, object]) -> tuple:
    """A template variant as a hashable value: its name and its defines in order."""
    return name, tuple(sorted(defines.items()))


def _flags(defines: dict[str, object]) -> list[str]:
    return [f"-D{k}={v}" for k, v in sorted(defines.items())]


class ShaderCompiler:
    """Compiles template variants to SPIR-V (memoized, and cached on disk)."""

    def __init__(self, glslc: str | None = None, target: str = "vulkan1.2"):
        self.glslc = glslc or find_glslc()
        self.target = target
        self.n_compiled = 0
        self._memo: dict[tuple, bytes] = {}
        self._lock = threading.Lock()

    def key(self, name: str, defines: dict[str, object]) -> str:
        flags = " ".join(_flags(defines))
        text = f"{glslc_version(self.glslc)}\n{self.target}\n{name}\n{flags}\n{_sources(name)}"
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def spirv(self, name: str, defines: dict[str, object]) -> bytes:
        code = self._memo.get(variant_id(name, defines))
        if code is None:
            path = self._path(name, defines)
            code = self._memo[variant_id(name, defines)] = path.read_bytes() if path.exists() \
                else self._build(name, defines, path)
        return code

    def compile_all(self, variants: Iterable[tuple[str, dict[str, object]]]) -> int:
        """Compile the variants that are neither memoized nor on disk side by side, one glslc
        per CPU (a big quantized mul_mv takes glslc seconds and one core), as ggml's
        vulkan-shaders-gen runs its glslc jobs. Every variant that compiles is cached; then the
        first failure, if any, is raised. Returns the number compiled."""
        todo = {}
        for name, defines in variants:
            vid = variant_id(name, defines)
            if vid not in self._memo and vid not in todo and not (path := self._path(name, defines)).exists():
                todo[vid] = (name, defines, path)
        if not todo:
            return 0
        workers = min(len(todo), compile_workers())
        with ThreadPoolExecutor(workers) as pool:   # each thread waits on its glslc process
            futures = [pool.submit(self._build, *job) for job in todo.values()]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise errors[0]
        return len(futures)

    def _path(self, name: str, defines: dict[str, object]) -> Path:
        return cache_dir() / f"{name}-{self.key(name, defines)}.spv"

    def _build(self, name: str, defines: dict[str, object], path: Path) -> bytes:
        """Compile the variant, store it at `path` in the disk cache (atomically) and memoize it."""
        code = self._compile(name, defines)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(code)
        os.replace(tmp, path)
        self._memo[variant_id(name, defines)] = code
        return code

    def _compile(self, name: str, defines: dict[str, object]) -> bytes:
        src = SHADER_DIR / f"{name}.comp"
        if not src.exists():
            raise ShaderError(f"no shader template {src.name}")
        cmd = [self.glslc, "-fshader-stage=compute", f"--target-env={self.target}", "-O", "-I", str(SHADER_DIR)]
        cmd += _flags(defines)
        cmd += [str(src), "-o", "-"]
        out = subprocess.run(cmd, capture_output=True, check=False)
        if out.returncode != 0:
            flags = " ".join(_flags(defines))
            raise ShaderError(f"glslc failed on {src.name} ({flags}):\n{out.stderr.decode(errors='replace')}")
        with self._lock:
            self.n_compiled += 1
        return out.stdout
