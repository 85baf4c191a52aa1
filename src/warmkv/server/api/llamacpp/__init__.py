"""llama.cpp server's routes: /infill, /tokenize, /detokenize, /apply-template."""
