"""LLVM IR to object code: verify, optimise (the O3 pipeline), emit for the target machine."""

from __future__ import annotations

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


def optimize_and_emit(module: ir.Module, target: Target, speed_level: int = 3) -> bytes:
    """Object code for `module` (which is verified first, and optimised at `speed_level`). Each
    call uses its own LLVM context, so calls may run in parallel threads (llvmlite releases the
    GIL inside LLVM)."""
    ref = parse_and_verify(module, llvm.create_context())
    machine = target.machine()
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
