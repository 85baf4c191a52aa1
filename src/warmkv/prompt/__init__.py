"""Text around the model: chat templates, reasoning, turn memory, infill, tokens, stops, constraints, sampling."""
