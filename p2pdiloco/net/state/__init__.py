"""Global-state sync: heads, catch-up by deltas or downloads, plausible-move bounds, strikes and
revocations (docs/trust.md, "Earned claims")."""
