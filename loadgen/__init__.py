"""Load generation and benchmarks: request-length distributions and the engine benchmarks."""
