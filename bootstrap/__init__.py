"""The bootstrap peer: a DHT-only peer that introduces nodes to each other and trains nothing."""
