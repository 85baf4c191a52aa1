"""State the server keeps for the Responses API: stored responses and their chains."""
