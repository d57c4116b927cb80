"""The transport: authenticated streams between peers (hivemind's p2pd), the serving side with
its limits, sessions, framing, drops and bans, reachability and relays, the swarm clock, and the
in-memory network that stands in for p2pd in protocol tests (docs/architecture.md)."""
