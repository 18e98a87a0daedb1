"""The state layer: split/merge/mirror/move of a stateful endpoint's ranges (DESIGN.md §5)."""
