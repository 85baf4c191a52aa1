"""A prompt past the context window, in each API's own words: the words its clients act on.

Harnesses compact their conversation when the API says the prompt does not fit, and they
recognise that by the hosted API's wording, not by warmkv's: Claude Code matches Anthropic's
`prompt is too long: N tokens > M maximum` (and reads N and M out of it), Codex and opencode
OpenAI's `context_length_exceeded` code, qwen-code and pi the phrases of both. So a context
overflow is answered as each API answers it; the body of the OpenAI-shaped ones also carries
warmkv's own counts (stage, resident_tokens, additional_tokens, num_ctx).
"""

from __future__ import annotations

from dataclasses import dataclass

DIALECTS = ("openai", "responses", "anthropic", "ollama")


@dataclass(frozen=True)
class Overflow:
    """A request of `prompt` tokens and up to `output` more in a window of `num_ctx` tokens."""

    prompt: int
    output: int
    num_ctx: int

    @property
    def prompt_alone(self) -> bool:
        """The prompt leaves no room for even one output token."""
        return self.prompt >= self.num_ctx

    def openai(self) -> str:
        """Chat Completions' wording (`code: context_length_exceeded`)."""
        head = f"This model's maximum context length is {self.num_ctx} tokens. However, "
        if self.prompt_alone:
            return head + f"your messages resulted in {self.prompt} tokens. Please reduce the length of the messages."
        total = self.prompt + self.output
        return head + (
            f"you requested {total} tokens ({self.prompt} in the messages, {self.output} in the completion). "
            "Please reduce the length of the messages or completion."
        )

    def responses(self) -> str:
        """The Responses API's wording (the same code; param `input`)."""
        if not self.prompt_alone:  # the input fits; max_output_tokens does not
            return self.openai()
        return (
            "Your input exceeds the context window of this model. Please adjust your input and try again. "
            f"(input: {self.prompt} tokens; context window: {self.num_ctx} tokens)"
        )

    def anthropic(self) -> str:
        """Anthropic's invalid_request_error messages: the prompt alone, or with max_tokens."""
        if self.prompt > self.num_ctx:
            return f"prompt is too long: {self.prompt} tokens > {self.num_ctx} maximum"
        return (
            f"input length and `max_tokens` exceed context limit: {self.prompt} + {self.output} > {self.num_ctx}, "
            "decrease input length or `max_tokens` and try again"
        )

    def ollama(self) -> str:
        """What Ollama answers when it cannot cut a prompt to num_ctx (llm/llama_server.go), with the counts.

        Ollama itself first drops the oldest messages (truncate, on by default) and then the middle of
        the prompt (context shift); warmkv cuts nothing, so it answers as Ollama does when it may not."""
        return (
            "the prompt is longer than the context length currently available to the model; shorten the "
            "prompt, adjust the context length in settings, or use a model with a longer context length "
            f"({self.prompt} prompt tokens + {self.output} to generate > num_ctx={self.num_ctx})"
        )

    def message(self, dialect: str) -> str:
        return {
            "openai": self.openai,
            "responses": self.responses,
            "anthropic": self.anthropic,
            "ollama": self.ollama,
        }[dialect]()
