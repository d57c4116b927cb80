"""Records: every value a peer stores in the DHT or pushes, parsed at one boundary (``parse``),
signed per entry (``signed``), and their patches and pushes (docs/trust.md)."""
