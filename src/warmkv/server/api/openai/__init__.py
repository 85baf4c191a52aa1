"""OpenAI chat completions, completions, embeddings and models."""
