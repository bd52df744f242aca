"""LLVM IR to object code: verify, optimise (the O3 pipeline), emit for the target machine; and
many modules at once in forked worker processes.

llvmlite serialises every call into LLVM behind one process-wide lock, so threads compile one
module at a time. Worker processes do not share it: `compile_jobs` forks children that each
build and compile whole modules (the Python that generates the IR runs in parallel too) and
send back the object code.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import struct
import sys
import time
import warnings
from collections.abc import Callable, Sequence

import llvmlite.binding as llvm
import llvmlite.ir as ir

from llamir.backends.llvm.target import Target, init_llvm


class CodegenError(RuntimeError):
    """LLVM rejected a module this backend generated (a bug in a lowering; names the module)."""


def parse_and_verify(module: ir.Module, context=None) -> llvm.ModuleRef:
    init_llvm()
    text = str(module)
    try:
        ref = llvm.parse_assembly(text, context=context)
        ref.verify()
    except RuntimeError as err:
        raise CodegenError(f"module {module.name}: {err}") from None
    return ref


def optimize_and_emit(module: ir.Module, target: Target, speed_level: int = 3, codegen_opt: int = 3) -> bytes:
    """Object code for `module` (which is verified first, and optimised at `speed_level`; 0 runs
    no pass pipeline). `codegen_opt` is the code generator's level (0: fast instruction
    selection). Each call uses its own LLVM context."""
    ref = parse_and_verify(module, llvm.create_context())
    machine = target.machine(codegen_opt)
    ref.triple = target.triple
    ref.data_layout = str(machine.target_data)
    if speed_level:
        pto = llvm.create_pipeline_tuning_options(speed_level=speed_level)
        pto.loop_vectorization = True
        pto.slp_vectorization = True
        pto.loop_unrolling = True
        pb = llvm.create_pass_builder(machine, pto)
        pm = pb.getModulePassManager()
        pm.run(ref, pb)
    return machine.emit_object(ref)


# -- many modules in worker processes ----------------------------------------------------------
Job = Callable[[], bytes]


def compile_workers() -> int:
    """Processes worth forking for compiles: the CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def can_fork() -> bool:
    return hasattr(os, "fork") and sys.platform.startswith("linux")


def compile_jobs(jobs: Sequence[Job], workers: int,
                 names: Sequence[str] | None = None) -> list[tuple[bytes, float, float]]:
    """(object code, seconds, CPU seconds) of each job. With `workers` > 1 and more than one job, forked
    children take the jobs in order as they finish the last (the caller lists the costly ones
    first); otherwise, or where fork is not available, they run here one after another. The
    first job that fails raises its exception here (with a note naming it); a child killed by
    LLVM (a fatal error aborts only that child) raises CodegenError naming the job."""
    names = list(names) if names is not None else [f"job {i}" for i in range(len(jobs))]
    workers = min(workers, len(jobs))
    if workers <= 1 or not can_fork():
        return [_timed(job) for job in jobs]
    return _ForkPool(jobs, names, workers).run()


def _timed(job: Job) -> tuple[bytes, float, float]:
    t0, cpu0 = time.perf_counter(), time.thread_time()
    obj = job()
    return obj, time.perf_counter() - t0, time.thread_time() - cpu0


@contextlib.contextmanager
def _llvm_quiet():
    """Hold llvmlite's lock across fork(), so that no thread of this process is inside LLVM at
    that moment; the child inherits the lock as its own (it is re-entrant)."""
    lock = getattr(getattr(llvm, "ffi", None), "lib", None)
    lock = getattr(lock, "_lock", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # 3.12: fork() in a process with threads
        if lock is None:
            yield
        else:
            with lock:
                yield


class _ForkPool:
    """Children that run jobs by index: the parent writes an index (4 bytes, -1 to stop), the
    child answers with a length-prefixed pickle of ("ok", obj, seconds, CPU seconds) or
    ("error", exception)."""

    def __init__(self, jobs: Sequence[Job], names: Sequence[str], workers: int):
        self.jobs, self.names, self.workers = jobs, names, workers
        self.parent_fds: list[int] = []     # the parent's pipe ends: a new child closes its copies

    def run(self) -> list[tuple[bytes, float, float]]:
        results: list[tuple[bytes, float, float] | None] = [None] * len(self.jobs)
        children: dict[int, tuple[int, int, int]] = {}     # pid -> (to child, from child, job index)
        pending = iter(range(len(self.jobs)))
        failure: BaseException | None = None
        try:
            for _ in range(self.workers):
                pid, to_child, from_child = self._spawn()
                children[pid] = (to_child, from_child, -1)
            for pid in list(children):
                children[pid] = self._give(children[pid], next(pending, -1))
            while any(job >= 0 for _, _, job in children.values()):
                ready = self._wait([c[1] for c in children.values() if c[2] >= 0])
                for pid, (to_child, from_child, job) in list(children.items()):
                    if from_child not in ready:
                        continue
                    answer = _read_answer(from_child)
                    if answer is None:
                        died = CodegenError(f"{self.names[job]}: the compiler process died ({_exit_text(pid)})")
                        failure = failure or died
                        del children[pid]
                        continue
                    if answer[0] == "ok":
                        results[job] = answer[1:]
                    elif failure is None:
                        failure = answer[1]
                        failure.add_note(f"while compiling {self.names[job]} in a worker process")
                    children[pid] = self._give((to_child, from_child, -1), -1 if failure else next(pending, -1))
        finally:
            for pid, (to_child, from_child, _) in children.items():
                with contextlib.suppress(OSError):
                    os.write(to_child, struct.pack("<i", -1))
                os.close(to_child)
                os.close(from_child)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
        if failure is not None:
            raise failure
        return results   # type: ignore[return-value]

    def _spawn(self) -> tuple[int, int, int]:
        task_r, task_w = os.pipe()
        answer_r, answer_w = os.pipe()
        with _llvm_quiet():
            pid = os.fork()
            if pid == 0:                      # the child: never returns
                gc.disable()                  # no finalizers of the parent's objects run here
                for fd in self.parent_fds + [task_w, answer_r]:
                    os.close(fd)
                self._serve(task_r, answer_w)
        os.close(task_r)
        os.close(answer_w)
        self.parent_fds += [task_w, answer_r]
        return pid, task_w, answer_r

    def _serve(self, tasks: int, answers: int) -> None:
        status = 0
        try:
            while True:
                head = _read_exact(tasks, 4)
                index = struct.unpack("<i", head)[0] if head else -1
                if index < 0:
                    break
                try:
                    answer = ("ok", *_timed(self.jobs[index]))
                except BaseException as err:  # noqa: BLE001 - any failure goes back to the parent
                    answer = ("error", err)
                try:
                    data = pickle.dumps(answer)
                except Exception:  # noqa: BLE001 - an exception that does not pickle goes back as text
                    data = pickle.dumps(("error", CodegenError(f"{type(answer[1]).__name__}: {answer[1]}")))
                _write_all(answers, struct.pack("<Q", len(data)) + data)
        except BaseException:  # noqa: BLE001 - the parent sees the closed pipe
            status = 1
        finally:
            os._exit(status)

    @staticmethod
    def _give(child: tuple[int, int, int], index: int) -> tuple[int, int, int]:
        to_child, from_child, _ = child
        if index >= 0:
            _write_all(to_child, struct.pack("<i", index))
        return to_child, from_child, index

    @staticmethod
    def _wait(fds: list[int]) -> set[int]:
        import select

        ready, _, _ = select.select(fds, [], [])
        return set(ready)


def _read_exact(fd: int, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            return b""
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_answer(fd: int):
    head = _read_exact(fd, 8)
    if not head:
        return None
    data = _read_exact(fd, struct.unpack("<Q", head)[0])
    return pickle.loads(data) if data else None


def _exit_text(pid: int) -> str:
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return "exit status unknown"
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit status {os.WEXITSTATUS(status)}"
