"""Kernels beyond plain JAX, each a backend (kvlab.backends) chosen by
model.attention_impl and imported only when asked for: pallas/ (Pallas
kernels: Triton on CUDA, the interpreter on CPU) and native/ (C++ CPU kernels
through XLA's FFI). Nothing in kvlab's core imports them."""
