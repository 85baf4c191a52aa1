"""What every API shares: one chat turn, generation, streams, the wire, sampling and reuse reports."""
