"""Benchmarks: kernel microbenchmarks (CPU through pytest-benchmark, GPU through ``bench.kernels``),
the GPU suite runner (``bench.gpu_suite``) and the engine CPU benchmark (``bench.engine_cpu``)."""
