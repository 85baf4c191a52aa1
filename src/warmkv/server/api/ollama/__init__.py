"""Ollama's /api routes."""
