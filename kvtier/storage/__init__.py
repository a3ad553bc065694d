"""Tier storage: one buffer (or file set) per tier and layer group, addressed by slot."""
