"""attention kernels (being written)."""
