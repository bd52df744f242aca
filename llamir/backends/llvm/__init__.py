"""The LLVM JIT CPU backend: whole splits compiled with llvmlite.

    graph (IR) --passes (cse, fusion, dce)--> Plan (lowering.py: buffers, kernel steps, barriers,
    arena) --codegen.py--> one LLVM module: a function per distinct kernel + the split entry
    --compiler.py--> object code (cached: cache.py) --runtime.py--> linked into the process,
    run by a persistent native thread pool (executable.py binds arrays and dims per call).

Kernels live in kernels/: element-wise chains, row ops (norms, softmax, rope), gathers and
scatters, matmuls (float and quantized, with int8 dot products), attention.
"""

from llamir.backends.llvm.backend import LLVMBackend

__all__ = ["LLVMBackend"]
