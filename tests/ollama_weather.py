"""The tool and history the Ollama tests call it with: one call in the history shows the 135M model
how calls look; with tools offered (and no tool_choice in Ollama's API) it then calls the tool itself,
its call constrained to the schema. The ollama client builds the tool's schema from its docstring."""

from __future__ import annotations


def get_weather(city: str) -> str:
    """Get the current weather for a city.

    Args:
      city: The city
    """
    return "Sunny, 24 C"


CALLED = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "user", "content": "What is the weather in Tokyo?"},
]  # fmt: skip
