"""(kernels to come)"""
