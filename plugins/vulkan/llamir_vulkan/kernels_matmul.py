"""matmul kernels (being written)."""
