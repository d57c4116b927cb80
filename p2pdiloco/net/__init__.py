"""Networking layer: the only package that imports hivemind (libp2p daemon, DHT)."""
