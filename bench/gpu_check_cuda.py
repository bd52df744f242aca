#!/usr/bin/env python3
"""The CUDA plugin's checks on a real GPU in one run, prepared on a machine without one.

The GPU machine this project is sometimes lent (an H200 with NVIDIA's driver, Python 3.12, no
package registry, minutes of device time) gets a copy of the repository and the folder that
`prepare` fills:

    python bench/gpu_check_cuda.py prepare --dir .device          # here, no GPU needed
    python3 bench/gpu_check_cuda.py run --dir .device --out "$OUT" --budget 360   # there

prepare writes into --dir:
  - llvmlite (this machine's version: llamir's LLVM) for the GPU machine's Python, as a .tar.xz
    of its wheel's files (39 MB instead of the wheel's 60: a run carries 64 MiB at most), and
    the wheels of gguf and platformdirs, which that machine's Python may lack;
  - the PTX of every kernel the checks load (ptx/, an LLAMIR_CUDA_CACHE), made here by running
    test-backend-ops on the emulator and recording the checks' models (emit-ptx's driver), so
    the GPU machine spends its time on the driver's JIT and the runs, not on LLVM.

run installs llamir and the plugin with those (pip, offline, editable: the plugin is found
through its entry point), then runs each check in its own process, since a kernel fault
poisons the process's CUDA context, with its log in --out:
  1. pytest -m gpu tests/backends/cuda: libcuda on the GPU; the conformance models against the
     numpy reference (batch and token by token, flash attention off and on); the 110M models'
     shapes against the LLVM CPU backend;
  2. llamir test-backend-ops -b cuda, resumed in a fresh process after an op that poisons the
     context;
  3. bench/bench_cuda.py: pp512 and tg128 of the 110M models against the bandwidth roof;
and prints a summary. Each step stops at its share of --budget seconds. `--driver emulator`
runs the same steps on the emulator, to try the script on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = ("gguf", "platformdirs")  # llamir's dependencies a GPU image may lack (llguidance is lazy)
MANYLINUX = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
BENCH_MODELS = "big-q4_0,big-q8_0"
TABLE_LINES = ("|", "CUDA device", "copy bandwidth", "big-", "small-", "large-")  # bench_cuda.py's results
# one test-backend-ops case as the CLI prints it: "  MUL_MAT(type_a=q4_0,...): NMSE = ... OK"
# (a FAIL's message may run over several lines: a JIT error carries the compiler's log)
CASE_LINE = re.compile(r"^(  ([A-Z0-9_]+)\((.*?)\):.*? (OK|FAIL|not supported))$", re.M | re.S)
# CUresults after which a context is unusable: the rest of that process's launches fail with them
POISON = ("CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED",
          "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_INVALID_PC",
          "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA_ERROR_LAUNCH_TIMEOUT", "CUDA_ERROR_ASSERT")


# -- prepare (here) ----------------------------------------------------------------------------------
def prepare(folder: Path, python: str) -> None:
    from importlib.metadata import version

    folder.mkdir(parents=True, exist_ok=True)
    llvmlite = version("llvmlite")
    tag = "cp" + python.replace(".", "")
    archive = folder / f"llvmlite-{llvmlite}-{tag}.tar.xz"
    if not archive.exists():
        with tempfile.TemporaryDirectory() as tmp:
            _pip_download(f"llvmlite=={llvmlite}", python, Path(tmp))
            (wheel,) = Path(tmp).glob("llvmlite-*.whl")
            _repack_xz(wheel, archive)
    wheels = folder / "wheels"
    wheels.mkdir(exist_ok=True)
    for name in WHEELS:
        if not list(wheels.glob(f"{name}-*.whl")):
            _pip_download(f"{name}=={version(name)}", python, wheels)
    ptx = folder / "ptx"
    env = {**os.environ, "LLAMIR_CUDA_DRIVER": "emulator", "LLAMIR_CUDA_CACHE": str(ptx)}
    subprocess.run([sys.executable, __file__, "fill-ptx"], env=env, check=True, cwd=REPO)
    manifest = {"llvmlite": llvmlite, "python": python, "llvmlite_archive": archive.name,
                "wheels": sorted(p.name for p in wheels.glob("*.whl"))}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    print(f"{folder}: {size / 1e6:.1f} MB ({manifest})")


def _pip_download(requirement: str, python: str, dest: Path) -> None:
    platforms = [arg for p in MANYLINUX for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp", *platforms, "-d", str(dest), requirement],
                   check=True)


def _repack_xz(wheel: Path, archive: Path) -> None:
    """The wheel's files as a .tar.xz (the run unpacks it onto PYTHONPATH)."""
    with tempfile.TemporaryDirectory() as tmp:
        zipfile.ZipFile(wheel).extractall(tmp)
        (Path(tmp) / "llvmlite" / "binding" / "libllvmlite.so").chmod(0o755)
        partial = archive.with_suffix(".partial")
        subprocess.run(["tar", "-C", tmp, "-cf", str(partial), "--use-compress-program", "xz -9 -T0", "."],
                       check=True)
        partial.replace(archive)


def fill_ptx() -> None:
    """Run what the checks run on the emulator (or record it) and write every kernel's PTX into
    LLAMIR_CUDA_CACHE (set by prepare)."""
    sys.path[:0] = [str(REPO / "bench"), str(REPO / "tests" / "backends" / "cuda")]
    from bench_llvm import BIG
    from llamir_cuda import kir
    from llamir_cuda.emit import model_kernels
    from test_cuda_models import MODEL_CASES  # the models the gpu tests run

    from llamir.backends import get_backend
    from llamir.frontend.synth import SynthSpec, write_model
    from llamir.testing.backend_ops import run_backend_ops
    from llamir.testing.conformance import N_BATCH, Case, case_model

    t0 = time.perf_counter()
    report = run_backend_ops(get_backend("cuda"))
    print(f"test-backend-ops on the emulator: {report.summary()} ({time.perf_counter() - t0:.0f} s)")
    with tempfile.TemporaryDirectory() as tmp:
        for dtype, arch in MODEL_CASES:
            model_kernels(case_model(Path(tmp), Case(arch, dtype, 2, dtype in ("f16", "q4_0"))), n_ubatch=N_BATCH)
        for dtype in ("q4_0", "q8_0", "f16"):  # the 110M models' kernels: their shapes in two layers
            spec = SynthSpec(arch="llama", dtype=dtype, seed=1, **{**BIG, "n_layer": 2})
            model_kernels(write_model(Path(tmp) / f"big-{dtype}.gguf", spec), n_ubatch=512)
    kernels = kir.defined_kernels()
    for kernel in kernels:
        kernel.ptx("sm_90")
    print(f"{len(kernels)} kernels' sm_90 PTX in {kir.cache_dir()} ({time.perf_counter() - t0:.0f} s)")


# -- run (on the GPU machine) ------------------------------------------------------------------------
class Run:
    """The steps of one run, their logs in `out`, each stopped at its share of the budget."""

    def __init__(self, folder: Path, out: Path, budget: float, driver: str):
        self.folder, self.out, self.driver = folder.resolve(), out.resolve(), driver
        self.deadline = time.monotonic() + budget
        self.site = Path(tempfile.gettempdir()) / "llamir-gpu-check-site"
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", LLAMIR_CUDA_DRIVER=driver,
                        LLAMIR_CUDA_CACHE=str(self.folder / "ptx"),
                        XDG_CACHE_HOME=str(Path(tempfile.gettempdir()) / "llamir-gpu-check-cache"))
        if driver == "emulator":
            self.env["LLAMIR_CUDA_GPU_TESTS"] = "emulator"
        self.summary: list[str] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def sh(self, args: list[str], log: str, limit: float, echo: bool = True, **env: str) -> tuple[int | None, str]:
        """Run `args` in the repository (with `env` added to the environment), its output appended
        to out/log (and echoed), killed with its process group after `limit` seconds: (exit status
        or None when killed, output)."""
        limit = max(1.0, min(limit, self.left()))
        started = time.monotonic()
        with open(self.out / log, "a") as f:
            f.write(f"$ {' '.join(args)}   (limit {limit:.0f} s)\n")
            f.flush()
            proc = subprocess.Popen(args, cwd=REPO, env={**self.env, **env}, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
            timer = _Killer(proc, limit)
            lines = []
            for line in proc.stdout:
                lines.append(line)
                f.write(line)
                f.flush()
                if echo:
                    sys.stdout.write(line)
            status = proc.wait()
            killed = timer.cancel()
            took = time.monotonic() - started
            f.write(f"-- {'killed at its limit' if killed else f'exit {status}'} after {took:.1f} s\n")
        print(f"-- {args[1] if len(args) > 1 else args[0]}: {'killed' if killed else f'exit {status}'} "
              f"after {took:.1f} s", flush=True)
        return (None if killed else status), "".join(lines)

    def python(self, *args: str, log: str, limit: float, echo: bool = True, **env: str):
        return self.sh([sys.executable, *args], log, limit, echo, **env)

    # -- steps -----------------------------------------------------------------------------------
    def environment(self) -> None:
        commands = [["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,"
                     "clocks.max.sm,power.limit", "--format=csv"],
                    [sys.executable, "-c", "import sys, numpy; print(sys.version); print('numpy', numpy.__version__)"],
                    [sys.executable, "-c", "import llvmlite; print('llvmlite (before)', llvmlite.__version__)"],
                    ["nproc"], ["uname", "-r"]]
        for args in commands:
            if shutil.which(args[0]) or args[0] == sys.executable:
                self.sh(args, "env.txt", 30)

    def install(self) -> bool:
        manifest = json.loads((self.folder / "manifest.json").read_text())
        self.site.mkdir(parents=True, exist_ok=True)
        have = _module_versions(("llvmlite", *WHEELS))
        if have.get("llvmlite") != manifest["llvmlite"]:
            with tarfile.open(self.folder / manifest["llvmlite_archive"]) as tar:
                tar.extractall(self.site, filter="data")
        for wheel in manifest["wheels"]:
            if wheel.split("-")[0] not in have:
                zipfile.ZipFile(self.folder / "wheels" / wheel).extractall(self.site)
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.site), os.environ.get("PYTHONPATH")]))
        status, _ = self.python("-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                                "-e", ".", "-e", "plugins/cuda", log="install.log", limit=240)
        if status != 0:
            print("pip could not install llamir and the plugin: naming them to Python by hand instead", flush=True)
            _write_dist_info(self.site)
            self.env["PYTHONPATH"] += os.pathsep + os.pathsep.join([str(REPO), str(REPO / "plugins" / "cuda")])
        self.python("-c", "import llvmlite, llamir, llamir_cuda; print('llvmlite', llvmlite.__version__, "
                    "llvmlite.__file__); print('llamir', llamir.__file__); print('plugin', llamir_cuda.__file__)",
                    log="install.log", limit=60)
        status, text = self.python("-m", "llamir.cli", "backends", log="install.log", limit=60)
        line = next((ln for ln in text.splitlines() if "cuda0" in ln), "no cuda0 line")
        self.summary.append(f"install: {line.strip()}")
        return status == 0 and "cuda0" in line and "not usable" not in line

    def pytest(self, limit: float) -> None:
        status, text = self.python("-m", "pytest", "-m", "gpu", "tests/backends/cuda", "-v", "-s", "-rs",
                                   "-p", "no:cacheprovider", "--durations=15", log="pytest_gpu.log", limit=limit)
        counts = re.findall(r"=+ (.*(?:passed|failed|skipped|error).*) in [\d.]+s", text)
        self.summary.append(f"pytest -m gpu: {counts[-1] if counts else 'no result'}"
                            + (" (killed at its limit)" if status is None else ""))
        self.summary += [f"  {m}" for m in re.findall(r"gpu (?:conformance|110m-shape) .*", text)]
        self.summary += [f"  {m}" for m in re.findall(r"^(?:FAILED|ERROR) .*", text, re.M)]

    def backend_ops(self, limit: float) -> None:
        """test-backend-ops -b cuda; after a fault that poisons the context, again from the next op."""
        _, text = self.python("-c", "from llamir.testing.backend_ops import all_cases; "
                              "print(' '.join(dict.fromkeys(c.op for c in all_cases(None))))",
                              log="backend_ops.log", limit=60, echo=False)
        order = text.split()
        stop = time.monotonic() + limit
        todo: list[str] | None = None  # None: every op
        passed = total = 0
        notes = []
        while todo is None or todo:
            args = ["-m", "llamir.cli", "test-backend-ops", "-b", "cuda"]
            for op in todo or ():
                args += ["-o", op]
            # each launch waits for its kernel, so a fault fails the case (and names the kernel) that made it
            status, text = self.python(*args, log="backend_ops.log", limit=stop - time.monotonic(), echo=False,
                                       CUDA_LAUNCH_BLOCKING="1")
            results = [(m[2], m[3], m[4], m[1]) for m in CASE_LINE.finditer(text)]  # op, params, status, line
            poisoned = next((i for i, r in enumerate(results) if r[2] == "FAIL" and any(p in r[3] for p in POISON)),
                            None)
            done = results if poisoned is None else results[:poisoned + 1]
            passed += sum(r[2] == "OK" for r in done)
            total += sum(r[2] != "not supported" for r in done)
            notes += [r[3].strip()[:300] for r in done if r[2] == "FAIL"]
            summary = re.search(r"\d+/\d+ tests passed.*", text)
            if poisoned is None or status is None:
                if not summary:
                    notes.append(f"ended without its summary ({'killed' if status is None else f'exit {status}'})")
                break
            first = results[poisoned][0].lower()
            notes.append(f"the context was poisoned in {first}: its later cases were skipped, the ops after it "
                         f"run again in a fresh process")
            todo = order[order.index(first) + 1:] if first in order else []
        self.summary.append(f"test-backend-ops -b cuda: {passed}/{total} passed")
        self.summary += [f"  FAIL {n}" for n in notes[:40]]

    def bench(self, limit: float, models: str, extra: list[str]) -> None:
        status, text = self.python("bench/bench_cuda.py", "--models", models, "--no-kernels", "--threads", "8",
                                   "--json", str(self.out / "bench_cuda.json"), *extra, log="bench.log", limit=limit)
        table = [ln for ln in text.splitlines() if ln.startswith(TABLE_LINES)]
        self.summary.append("bench/bench_cuda.py:" + (" killed at its limit" if status is None else ""))
        self.summary += [f"  {ln}" for ln in table if not ln.startswith("|---")]


class _Killer:
    """Kills a process's group after `limit` seconds unless cancelled first."""

    def __init__(self, proc: subprocess.Popen, limit: float):
        import threading

        self.killed = False
        self.timer = threading.Timer(limit, self._kill, (proc,))
        self.timer.start()

    def _kill(self, proc: subprocess.Popen) -> None:
        self.killed = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def cancel(self) -> bool:
        self.timer.cancel()
        return self.killed


def _ops_from(first: str, order: list[str]) -> list[str]:
    return order[order.index(first):] if first in order else []


def _module_versions(names) -> dict[str, str]:
    """The version of each of `names` this Python imports (absent: not importable)."""
    code = ("import importlib, json, sys\nout = {}\nfor n in sys.argv[1:]:\n    try:\n"
            "        out[n] = getattr(importlib.import_module(n), '__version__', '?')\n"
            "    except ImportError:\n        pass\nprint(json.dumps(out))")
    done = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True)
    return json.loads(done.stdout or "{}")


def _write_dist_info(site: Path) -> None:
    """Metadata that names llamir and the plugin's entry point, for a Python that has them on its
    path (when pip cannot install them)."""
    for name, entry_points in (("llamir", "[console_scripts]\nllamir = llamir.cli:main\n"),
                               ("llamir_cuda", "[llamir.backends]\ncuda = llamir_cuda:CudaReg\n")):
        info = site / f"{name}-0.1.0.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0.1.0\n")
        (info / "entry_points.txt").write_text(entry_points)


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    r = Run(Path(args.dir), out, args.budget, args.driver)
    carried = set(Path(args.dir, "ptx").rglob("*.ptx"))
    r.environment()
    ok = r.install()
    if ok:
        # shares of what is left: the bench needs its model written, the ops their JIT
        r.pytest(limit=0.4 * r.left())
        r.backend_ops(limit=0.55 * r.left())
        r.bench(r.left() - 5, args.models, args.bench_args.split())
    else:
        r.summary.append("stopped: cuda0 is not usable after the install (install.log)")
    made = sorted(p.stem for p in set(Path(args.dir, "ptx").rglob("*.ptx")) - carried)
    r.summary.append(f"PTX: {len(carried)} kernels carried, {len(made)} more made here {made[:20]}")
    text = "\n".join(["", "== summary ==", *r.summary, f"(budget left {r.left():.0f} s)"])
    (out / "summary.txt").write_text(text + "\n")
    print(text, flush=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="fill --dir with what the GPU machine needs (run here)")
    prep.add_argument("--dir", default=str(REPO / ".device"))
    prep.add_argument("--python", default="3.12", help="the GPU machine's Python version (for the wheels)")
    sub.add_parser("fill-ptx", help="(prepare's own step) the checks' kernels into LLAMIR_CUDA_CACHE")
    go = sub.add_parser("run", help="install and run the checks (on the GPU machine)")
    go.add_argument("--dir", default=str(REPO / ".device"))
    go.add_argument("--out", required=True, help="where the logs go")
    go.add_argument("--budget", type=float, default=360.0, help="seconds for the whole run")
    go.add_argument("--driver", choices=["libcuda", "emulator"], default="libcuda")
    go.add_argument("--models", default=BENCH_MODELS, help="the bench's models (bench_llvm.py's names)")
    go.add_argument("--bench-args", default="", help="more arguments for bench_cuda.py")
    args = p.parse_args(argv)
    if args.command == "prepare":
        prepare(Path(args.dir), args.python)
        return 0
    if args.command == "fill-ptx":
        fill_ptx()
        return 0
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
