"""Kernels written for the suite's own tests: each plants one known fault in a plain-PyTorch kernel."""
