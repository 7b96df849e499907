"""Icons and style sheets shipped with Gapless."""
