"""Who owns a session between requests: the pool, named sessions, admission, remote copies, routes."""
