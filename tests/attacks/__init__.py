"""Attack suite: real honest node processes against an attacker peer built on the project's library."""
