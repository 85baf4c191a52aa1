"""The peers benchmarks compare against: llama-cpp-python's Llama and HF transformers."""
