"""State the server keeps for the Responses API: stored responses, their chains, and conversations."""
