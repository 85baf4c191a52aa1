"""The engine: runtime, sessions and their resident context, prefix plans, turns and the scheduler."""
