"""The llama.cpp backend: llama-cpp-python's low-level API behind the Backend protocol."""
