"""Outer rounds: matchmaking into groups, gathering announcements, bandwidth shares, and the
butterfly all-reduce with its messages and results (docs/architecture.md)."""
