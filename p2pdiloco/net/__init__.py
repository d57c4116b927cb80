"""Networking layer: the only package that imports hivemind (libp2p daemon, DHT), in five rooms
(docs/architecture.md):

* ``transport``: authenticated streams between peers, serving limits, sessions, drops and bans,
  reachability and relays, the swarm clock, and the in-memory network of the protocol tests;
* ``records``: every value a peer stores or pushes, parsed at one boundary, signed per entry;
* ``rounds``: matchmaking into groups and the butterfly all-reduce (member and reducer sides);
* ``state``: heads, catch-up by deltas or downloads, plausible-move bounds, strikes, revocations;
* ``codecs``: the wire codecs of pseudo-gradients and states.
"""
