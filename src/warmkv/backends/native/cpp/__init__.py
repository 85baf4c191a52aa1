"""The native engine's C++ decode loop: the extension's build (csrc/ holds its sources)."""
